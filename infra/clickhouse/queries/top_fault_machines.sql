-- name: top_fault_machines
-- answers: The machines with the most trouble: detections naming them, decisions that named
-- answers: them, and times they were evicted, most evictions first (candidates for repair or
-- answers: for retiring from the pool).
-- param: job String = ''         the job ('' for every job)
-- param: since_ms Int64 = 0      only events at or after this Unix time (ms)
-- param: limit Int64 = 20        at most this many machines
SELECT
    machine,
    sum(detections) AS detections,
    sum(decisions) AS decisions,
    sum(evictions) AS evictions,
    groupUniqArrayArray(categories) AS categories
FROM
(
    SELECT node AS machine, count() AS detections, toUInt64(0) AS decisions,
           toUInt64(0) AS evictions, groupUniqArray(category) AS categories
    FROM detections FINAL
    WHERE (%(job)s = '' OR job = %(job)s) AND ts_ms >= %(since_ms)s AND node != ''
    GROUP BY node
    UNION ALL
    SELECT machine, toUInt64(0), count(), countIf(action = 'evict'), CAST([] AS Array(String))
    FROM decisions FINAL
    ARRAY JOIN machines AS machine
    WHERE (%(job)s = '' OR job = %(job)s) AND ts_ms >= %(since_ms)s
    GROUP BY machine
)
GROUP BY machine
ORDER BY evictions DESC, decisions DESC, detections DESC, machine
LIMIT %(limit)s
