-- Per node and round of its exporter's process source: the job's ranks alive there and their
-- process states.  When a machine fell silent is the first question of a postmortem of a frozen
-- or lost node: its last row here.

CREATE TABLE IF NOT EXISTS rank_liveness
(
    job String,
    node String,
    ts DateTime('UTC'),
    ts_ms Int64,
    ranks Array(Int32),
    states Array(String),
    interval_s Float64,
    seq UInt64
)
ENGINE = ReplacingMergeTree()
PARTITION BY toDate(ts)
ORDER BY (job, node, ts_ms);
