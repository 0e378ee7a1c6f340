-- name: dead_letters
-- answers: Records the pipeline could not process (malformed, unknown schema version, failed
-- answers: stage), counted per topic, stage and reason, with the newest time and an example.
-- param: since_ms Int64 = 0      only records dead-lettered at or after this Unix time (ms)
SELECT topic, stage, reason, count() AS records, max(ts_ms) AS last_ts_ms, any(substring(payload, 1, 200)) AS example
FROM dead_letters FINAL
WHERE ts_ms >= %(since_ms)s
GROUP BY topic, stage, reason
ORDER BY records DESC, topic, stage
