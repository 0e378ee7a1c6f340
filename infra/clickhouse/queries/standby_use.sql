-- name: standby_use
-- answers: Warm standbys the action service took into a job (swap_standbys: which machines
-- answers: they replaced) and new standbys it provisioned (replenish), in time order.
-- param: job String = ''         the job ('' for every job)
-- param: since_ms Int64 = 0      only steps at or after this Unix time (ms)
SELECT ts_ms, job, decision_id, step, duration_ms, detail
FROM action_events FINAL
WHERE (%(job)s = '' OR job = %(job)s) AND ts_ms >= %(since_ms)s
  AND step IN ('swap_standbys', 'replenish') AND phase = 'succeeded'
ORDER BY ts_ms, decision_id
