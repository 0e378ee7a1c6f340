-- name: incidents
-- answers: Every incident (a decision) in time order: its fault category and detection kind, the
-- answers: machines it named, what was done, and when -- seconds from the fault's first sign
-- answers: (the source event) to its detection, to localisation (a decision naming machines), to
-- answers: the decision, and to the recovery's success; outcome is succeeded, failed, held or
-- answers: pending (no recovery reported an end).
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
    if(outcome_phase = 'succeeded', outcome_ts_ms, toInt64(0)) AS recovered_ts_ms,
    round((detected_ts_ms - source_ts_ms) / 1000, 3) AS detected_s,
    if(notEmpty(machines), round((decided_ts_ms - source_ts_ms) / 1000, 3), NULL) AS localised_s,
    round((decided_ts_ms - source_ts_ms) / 1000, 3) AS decided_s,
    if(outcome_phase = 'succeeded', round((outcome_ts_ms - source_ts_ms) / 1000, 3), NULL) AS recovered_s
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
    -- succeed later).
    SELECT decision_id, argMax(phase, ts_ms) AS outcome_phase, max(ts_ms) AS outcome_ts_ms
    FROM action_events FINAL
    WHERE (%(job)s = '' OR job = %(job)s) AND step = 'recovery'
      AND phase IN ('succeeded', 'failed', 'held')
    GROUP BY decision_id
) AS ending USING decision_id
ORDER BY decided_ts_ms, decision_id
