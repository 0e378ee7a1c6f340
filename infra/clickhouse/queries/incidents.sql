-- name: incidents
-- answers: Every incident (a decision) in time order: its fault category and detection kind, the
-- answers: machines it named, what was done, and when -- seconds from the fault's first sign
-- answers: (the source event) to its detection, to localisation (a decision naming machines), to
-- answers: the decision, and to recovered: the job's first training step after a successful
-- answers: recovery (training again, not merely the procedure done); procedure_s is the
-- answers: recovery procedure alone, from the decision to its end.  Outcome is succeeded,
-- answers: failed, held or pending (no recovery reported an end).
-- param: job String = ''         the job ('' for every job)
-- param: since_ms Int64 = 0      only incidents decided at or after this Unix time (ms)
-- param: decision String = ''    only this incident (its decision id; '' for all)
SELECT
    decision_id,
    job,
    action,
    category,
    kind,
    machines,
    group_kind,
    reason,
    source_ts_ms,
    detected_ts_ms,
    decided_ts_ms,
    if(outcome_phase = '', 'pending', outcome_phase) AS outcome,
    if(outcome_phase = '', toInt64(0), outcome_ts_ms) AS ended_ts_ms,
    if(outcome_phase = 'succeeded', first_step_ms, toInt64(0)) AS recovered_ts_ms,
    round((detected_ts_ms - source_ts_ms) / 1000, 3) AS detected_s,
    if(notEmpty(machines), round((decided_ts_ms - source_ts_ms) / 1000, 3), NULL) AS localised_s,
    round((decided_ts_ms - source_ts_ms) / 1000, 3) AS decided_s,
    if(recovered_ts_ms > 0, round((recovered_ts_ms - source_ts_ms) / 1000, 3), NULL) AS recovered_s,
    if(ended_ts_ms > 0, round((ended_ts_ms - decided_ts_ms) / 1000, 3), NULL) AS procedure_s
FROM
(
    SELECT
        decision_id, job, action, machines, group_kind, reason, decided_ts_ms,
        category, kind,
        if(first_detected_ms = 0, decided_ts_ms, first_detected_ms) AS detected_ts_ms,
        if(first_source_ms = 0, detected_ts_ms, first_source_ms) AS source_ts_ms
    FROM
    (
        SELECT decision_id, job, action, machines, group_kind, reason, ts_ms AS decided_ts_ms
        FROM decisions FINAL
        WHERE (%(job)s = '' OR job = %(job)s) AND ts_ms >= %(since_ms)s
          AND (%(decision)s = '' OR decision_id = %(decision)s)
    ) AS decision
    ANY LEFT JOIN
    (
        -- The decision's detections: the first one's time, kind and category.
        SELECT
            decision_id,
            min(det_ts_ms) AS first_detected_ms,
            min(det_source_ms) AS first_source_ms,
            argMin(det_category, det_ts_ms) AS category,
            argMin(det_kind, det_ts_ms) AS kind
        FROM
        (
            SELECT decision_id, detection_id
            FROM decisions FINAL
            ARRAY JOIN detection_ids AS detection_id
            WHERE (%(job)s = '' OR job = %(job)s) AND ts_ms >= %(since_ms)s
              AND (%(decision)s = '' OR decision_id = %(decision)s)
        ) AS named
        ANY INNER JOIN
        (
            SELECT
                detection_id,
                ts_ms AS det_ts_ms,
                if(source_ts_ms > 0, source_ts_ms, ts_ms) AS det_source_ms,
                category AS det_category,
                kind AS det_kind
            FROM detections FINAL
            WHERE (%(job)s = '' OR job = %(job)s)
        ) AS detection USING detection_id
        GROUP BY decision_id
    ) AS first_detection USING decision_id
) AS incident
ANY LEFT JOIN
(
    -- How the recovery ended (its last end phase: a held recovery an operator released may
    -- succeed later), and the job's first step after it: after the recovery's last restart when
    -- it made one (a restart ends once the scheduler runs the new processes; a step before it is
    -- the old processes' last), else after the recovery's end.  Rank 0 stands for the job, as in
    -- ettr.  ClickHouse 18.16 has no ASOF JOIN, and pairing every step with every recovery of
    -- its job costs steps x recoveries; so by the hour: the first step after the recovery in its
    -- own hour (the steps of that hour only), else the first step of the next hour that has one
    -- (each hour's first step, a few thousand rows a job-year).
    SELECT
        decision_id,
        any(outcome_phase) AS outcome_phase,
        any(outcome_ts_ms) AS outcome_ts_ms,
        minIf(step_ts_ms, step_ts_ms > resumed_from_ms) AS same_hour_ms,
        if(same_hour_ms > 0, same_hour_ms, any(later_hour_ms)) AS first_step_ms
    FROM
    (
        SELECT job, intDiv(ts_ms, 3600000) AS hour, ts_ms AS step_ts_ms
        FROM training_steps
        WHERE (%(job)s = '' OR job = %(job)s) AND rank = 0 AND ts_ms >= %(since_ms)s
          AND job IN (SELECT job FROM action_events WHERE step = 'recovery' AND ts_ms >= %(since_ms)s)
    ) AS step
    ALL RIGHT JOIN
    (
        SELECT
            decision_id,
            job,
            hour,
            any(outcome_phase) AS outcome_phase,
            any(outcome_ts_ms) AS outcome_ts_ms,
            any(resumed_from_ms) AS resumed_from_ms,
            minIf(hour_first_ms, step_hour > hour) AS later_hour_ms
        FROM
        (
            SELECT job, intDiv(ts_ms, 3600000) AS step_hour, min(ts_ms) AS hour_first_ms
            FROM training_steps
            WHERE (%(job)s = '' OR job = %(job)s) AND rank = 0 AND ts_ms >= %(since_ms)s
              AND job IN (SELECT job FROM action_events WHERE step = 'recovery' AND ts_ms >= %(since_ms)s)
            GROUP BY job, step_hour
        ) AS step_hours
        ALL RIGHT JOIN
        (
            SELECT
                decision_id,
                job,
                argMaxIf(phase, ts_ms, step = 'recovery') AS outcome_phase,
                maxIf(ts_ms, step = 'recovery') AS outcome_ts_ms,
                maxIf(ts_ms, step = 'restart') AS restarted_ts_ms,
                if(restarted_ts_ms > 0, restarted_ts_ms, outcome_ts_ms) AS resumed_from_ms,
                intDiv(resumed_from_ms, 3600000) AS hour
            FROM action_events FINAL
            WHERE (%(job)s = '' OR job = %(job)s) AND ts_ms >= %(since_ms)s
              AND ((step = 'recovery' AND phase IN ('succeeded', 'failed', 'held'))
                   OR (step = 'restart' AND phase = 'succeeded'))
            GROUP BY decision_id, job
        ) AS ended USING job
        GROUP BY decision_id, job, hour
    ) AS recovery USING job, hour
    GROUP BY decision_id
) AS ending USING decision_id
ORDER BY decided_ts_ms, decision_id
