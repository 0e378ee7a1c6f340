-- name: decisions_for_machine
-- answers: Every decision that named a machine, newest first, with its reason and evidence:
-- answers: what TrainGuard thought of this machine and why.
-- param: machine String          the machine (node name)
-- param: since_ms Int64 = 0      only decisions at or after this Unix time (ms)
SELECT ts_ms, job, decision_id, action, group_kind, machines, reason, evidence
FROM decisions FINAL
WHERE has(machines, %(machine)s) AND ts_ms >= %(since_ms)s
ORDER BY ts_ms DESC, decision_id
