-- name: evictions
-- answers: Every machine the action service evicted (cordoned and took out of the job), when,
-- answers: for which incident and fault, and how that recovery ended.
-- param: job String = ''         the job ('' for every job)
-- param: since_ms Int64 = 0      only evictions at or after this Unix time (ms)
SELECT machine, evicted_ts_ms, job, decision_id, category, kind, outcome
FROM
(
    SELECT decision_id, job, machine, min(ts_ms) AS evicted_ts_ms
    FROM action_events FINAL
    ARRAY JOIN machines AS machine
    WHERE (%(job)s = '' OR job = %(job)s) AND ts_ms >= %(since_ms)s
      AND step = 'evict' AND phase = 'succeeded'
    GROUP BY decision_id, job, machine
) AS evicted
ANY LEFT JOIN
(
    SELECT decision_id, category, kind, outcome FROM ({{incidents}})
) AS incident USING decision_id
ORDER BY evicted_ts_ms, machine
