-- name: incident_steps
-- answers: What the action service did for one incident: every step of its recovery (stop,
-- answers: diagnose, evict, swap_standbys, restart, ...) with its phase, time, duration and detail.
-- param: decision String         the incident's decision id
SELECT ts_ms, step, phase, duration_ms, machines, detail
FROM action_events FINAL
WHERE decision_id = %(decision)s
ORDER BY ts_ms, event_id
