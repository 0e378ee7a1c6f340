-- Control plane: detections, decisions, action events, commands, dead letters.
-- Monthly partitions (kept longer than raw telemetry); keyed by their ids so at-least-once
-- redelivery and replays never double a row.

CREATE TABLE IF NOT EXISTS detections
(
    detection_id String,
    job String,
    ts DateTime('UTC'),
    ts_ms Int64,
    kind String,
    category String,
    severity String,
    action String,
    node String,
    ranks Array(Int32),
    score Nullable(Float64),
    message String,
    evidence String,
    source_ts_ms Int64
)
ENGINE = ReplacingMergeTree()
PARTITION BY toYYYYMM(ts)
ORDER BY (job, detection_id);

CREATE TABLE IF NOT EXISTS decisions
(
    decision_id String,
    job String,
    ts DateTime('UTC'),
    ts_ms Int64,
    action String,
    machines Array(String),
    ranks Array(Int32),
    group_kind String,
    reason String,
    detection_ids Array(String),
    evidence String
)
ENGINE = ReplacingMergeTree()
PARTITION BY toYYYYMM(ts)
ORDER BY (job, decision_id);

CREATE TABLE IF NOT EXISTS action_events
(
    event_id String,
    decision_id String,
    job String,
    ts DateTime('UTC'),
    ts_ms Int64,
    step String,
    phase String,
    action String,
    duration_ms Float64,
    detail String,
    machines Array(String),
    ranks Array(Int32)
)
ENGINE = ReplacingMergeTree()
PARTITION BY toYYYYMM(ts)
ORDER BY (job, decision_id, event_id);

CREATE TABLE IF NOT EXISTS commands
(
    command_id String,
    ts DateTime('UTC'),
    ts_ms Int64,
    kind String,
    node String,
    job String,
    args String
)
ENGINE = ReplacingMergeTree()
PARTITION BY toYYYYMM(ts)
ORDER BY command_id;

CREATE TABLE IF NOT EXISTS dead_letters
(
    ts DateTime('UTC'),
    ts_ms Int64,
    topic String,
    stage String,
    reason String,
    partition Int32,
    offset Int64,
    key String,
    payload String,
    payload_b64 UInt8
)
ENGINE = ReplacingMergeTree()
PARTITION BY toYYYYMM(ts)
-- A Kafka record is dead-lettered once per stage however often it is redelivered; records
-- without an offset (-1: not from Kafka) are told apart by time.
ORDER BY (topic, partition, offset, stage, if(offset < 0, ts_ms, 0));
