-- name: training_curve
-- answers: Every step one rank reported, in time order: loss, step time, and whether the step
-- answers: survived (0: its work was lost to a restart and the step was recomputed later).
-- param: job String              the job
-- param: rank Int32 = 0          the rank that stands for the job
-- param: since_ms Int64 = 0      only steps that ended at or after this Unix time (ms)
SELECT
    step,
    ts_ms,
    loss,
    step_time_s,
    ts_ms = final_ts_ms AS survived
FROM
(
    SELECT step, ts_ms, loss, step_time_s
    FROM training_steps FINAL
    WHERE job = %(job)s AND rank = %(rank)s AND ts_ms >= %(since_ms)s
) AS occurrence
ANY LEFT JOIN
(
    SELECT step, max(ts_ms) AS final_ts_ms
    FROM training_steps FINAL
    WHERE job = %(job)s AND rank = %(rank)s
    GROUP BY step
) AS last USING step
ORDER BY ts_ms, step
