-- Training workload: step telemetry, log lines, process exits, stack dumps.

-- ts_ms is part of the key: a step recomputed after a restart from checkpoint is a new row,
-- while a redelivered step (same event, same ts_ms) collapses.
CREATE TABLE IF NOT EXISTS training_steps
(
    job String,
    rank UInt32,
    step UInt64,
    node String,
    ts DateTime('UTC'),
    ts_ms Int64,
    loss Nullable(Float64),
    grad_norm Nullable(Float64),
    step_time_s Nullable(Float64),
    tokens Nullable(UInt64),
    tokens_per_s Nullable(Float64),
    mfu Nullable(Float64),
    dropped UInt64
)
ENGINE = ReplacingMergeTree()
PARTITION BY toDate(ts)
ORDER BY (job, rank, step, ts_ms);

-- (node, source, seq, line_hash) identifies a line: seq is the position in the source and
-- line_hash guards against positions reused after log rotation.
CREATE TABLE IF NOT EXISTS log_lines
(
    node String,
    job String,
    rank Int32,
    ts DateTime('UTC'),
    ts_ms Int64,
    source String,
    seq Int64,
    line_hash UInt64,
    line String
)
ENGINE = ReplacingMergeTree()
PARTITION BY toDate(ts)
ORDER BY (node, source, seq, line_hash);

CREATE TABLE IF NOT EXISTS process_exits
(
    node String,
    job String,
    rank Int32,
    pid UInt32,
    role String,
    ts DateTime('UTC'),
    ts_ms Int64,
    exit_code Nullable(Int16),
    signal Nullable(UInt8),
    reason String,
    traceback String
)
ENGINE = ReplacingMergeTree()
PARTITION BY toDate(ts)
ORDER BY (job, node, pid, ts_ms);

CREATE TABLE IF NOT EXISTS stack_dumps
(
    job String,
    capture_id String,
    round UInt16,
    node String,
    rank Int32,
    pid UInt32,
    role String,
    ts DateTime('UTC'),
    ts_ms Int64,
    top_frames Array(String),
    threads_json String,
    process_tree_json String,
    raw_text String,
    error String
)
ENGINE = ReplacingMergeTree()
PARTITION BY toDate(ts)
ORDER BY (job, capture_id, round, rank, pid);
