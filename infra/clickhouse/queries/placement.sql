-- name: placement
-- answers: How far each swap spread the job's communication groups over network pods: the
-- answers: largest DP- and PP-group spread (pods one group spans) before and after the swap, and
-- answers: whether the planner's choice was exact or heuristic (Arnold's objective, detectors/placement).
-- param: job String = ''         the job ('' for every job)
-- param: since_ms Int64 = 0      only swaps at or after this Unix time (ms)
SELECT ts_ms, job, decision_id,
       toUInt32OrZero(extract(detail, 'dp_spread ([0-9]+)->')) AS dp_spread_before,
       toUInt32OrZero(extract(detail, 'dp_spread [0-9]+->([0-9]+)')) AS dp_spread_after,
       toUInt32OrZero(extract(detail, 'pp_spread ([0-9]+)->')) AS pp_spread_before,
       toUInt32OrZero(extract(detail, 'pp_spread [0-9]+->([0-9]+)')) AS pp_spread_after,
       extract(detail, 'pp_spread [0-9]+->[0-9]+ \\(([a-z]+)\\)') AS method,
       detail
FROM action_events FINAL
WHERE (%(job)s = '' OR job = %(job)s) AND ts_ms >= %(since_ms)s
  AND step = 'swap_standbys' AND phase = 'succeeded' AND position(detail, 'dp_spread ') > 0
ORDER BY ts_ms, decision_id
