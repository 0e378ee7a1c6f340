-- One row per run of node tests (`trainguard diag`) on a node and what came of it: a preflight
-- before a job (Slurm prolog, Kubernetes init container) drained, cordoned or only warned.
-- Monthly partitions and kept out of the daily telemetry prune: a node's failures weeks ago
-- decide whether it is trusted again.  Keyed by check id, so a record sent again (the node's
-- pending records are resent by its next check) stays one row.

CREATE TABLE IF NOT EXISTS node_checks
(
    check_id String,
    node String,
    ts DateTime('UTC'),
    ts_ms Int64,
    origin String,
    job String,
    level String,
    outcome String,
    action String,
    policy String,
    failed_tests Array(String),
    reason String,
    duration_s Float64,
    results String
)
ENGINE = ReplacingMergeTree()
PARTITION BY toYYYYMM(ts)
ORDER BY (node, ts_ms, check_id);
