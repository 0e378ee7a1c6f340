-- One row per change of an evicted node's state on its way back into service (issue #39 item 4):
-- evicted, awaiting_repair, validating, returned, quarantined; who or what caused it (`by`: an
-- operator, an eviction's decision id, a validation's check id) and the reference that makes it
-- unique (`ref`).  A node's state is its latest row (ORDER BY ts_ms, seq).  Monthly partitions,
-- outside the daily telemetry prune: the quarantine rule reads weeks of history.  Keyed by node
-- and transition id, so a transition recorded again (a command repeated after a crash) stays one row.

CREATE TABLE IF NOT EXISTS node_transitions
(
    transition_id String,
    node String,
    ts DateTime('UTC'),
    ts_ms Int64,
    seq UInt32,
    from_state String,
    to_state String,
    cause String,
    by String,
    ref String,
    detail String
)
ENGINE = ReplacingMergeTree()
PARTITION BY toYYYYMM(ts)
ORDER BY (node, transition_id);
