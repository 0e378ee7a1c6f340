-- name: ettr
-- answers: The job's ETTR (ByteRobust's effective training time ratio): the step time of every
-- answers: step that survived (its last occurrence: steps recomputed after a restart, and steps
-- answers: whose loss was NaN or infinite, are lost work) over the wall-clock time from the start
-- answers: of the first step to the end of the last.
-- param: job String              the job
-- param: rank Int32 = 0          the rank that stands for the job (every rank steps together)
SELECT
    sum(kept_s) AS productive_s,
    (max(last_end_ms) - min(first_start_ms)) / 1000 AS wall_s,
    if(wall_s > 0, productive_s / wall_s, 0) AS ettr,
    count() AS steps,
    sum(occurrences) - count() AS recomputed_steps
FROM
(
    SELECT
        step,
        argMax(if(isFinite(ifNull(loss, 0)), ifNull(step_time_s, 0), 0), ts_ms) AS kept_s,
        max(ts_ms) AS last_end_ms,
        min(ts_ms - ifNull(step_time_s, 0) * 1000) AS first_start_ms,
        count() AS occurrences
    FROM training_steps FINAL
    WHERE job = %(job)s AND rank = %(rank)s
    GROUP BY step
)
