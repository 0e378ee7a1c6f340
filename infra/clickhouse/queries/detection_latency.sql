-- name: detection_latency
-- answers: How fast each kind of detection fires: seconds from the source event (the fault's
-- answers: first sign: a kernel log line, a missed heartbeat, a step) to the detection, as
-- answers: count, median, 95th percentile and worst, per detection kind.
-- param: job String = ''         the job ('' for every job)
-- param: since_ms Int64 = 0      only detections at or after this Unix time (ms)
SELECT
    kind,
    any(category) AS category,
    count() AS detections,
    round(quantileExact(0.5)(latency_s), 3) AS p50_s,
    round(quantileExact(0.95)(latency_s), 3) AS p95_s,
    round(max(latency_s), 3) AS max_s
FROM
(
    SELECT kind, category, (ts_ms - source_ts_ms) / 1000 AS latency_s
    FROM detections FINAL
    WHERE (%(job)s = '' OR job = %(job)s) AND ts_ms >= %(since_ms)s AND source_ts_ms > 0
)
GROUP BY kind
ORDER BY detections DESC, kind
