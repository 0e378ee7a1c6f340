-- Job declarations (topology, machines, standbys). The latest spec per job wins:
-- ReplacingMergeTree keeps the row with the highest ts_ms per job at merge time, and readers use
-- argMax(..., ts_ms) so they are exact before merges too.

CREATE TABLE IF NOT EXISTS job_specs
(
    job String,
    ts DateTime('UTC'),
    ts_ms Int64,
    tp UInt32,
    pp UInt32,
    dp UInt32,
    ranks_per_machine UInt32,
    rank_order String,
    machines Array(String),
    standbys Array(String),
    spec_json String
)
ENGINE = ReplacingMergeTree(ts_ms)
PARTITION BY toYYYYMM(ts)
ORDER BY job;
