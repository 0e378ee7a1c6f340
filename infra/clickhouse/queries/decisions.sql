-- name: decisions
-- answers: Every decision for a job in time order, with the machines and ranks it named, its
-- answers: reason and its evidence (JSON: the detection, and for stack and Flight Recorder
-- answers: verdicts the classes of stacks and the stuck collectives that decided).
-- param: job String              the job
-- param: since_ms Int64 = 0      only decisions at or after this Unix time (ms)
SELECT ts_ms, decision_id, action, group_kind, machines, ranks, reason, detection_ids, evidence
FROM decisions FINAL
WHERE job = %(job)s AND ts_ms >= %(since_ms)s
ORDER BY ts_ms, decision_id
