-- PyTorch Flight Recorder dumps, one row per rank and dump: on a capture (capture_id, beside the
-- same capture's stack_dumps) or PyTorch's own on a collective timeout (trigger 'timeout').
-- groups_json / entries_json hold the dump's process groups and its newest entries as shipped
-- (detectors/flight_recorder/events.py); `trainguard fr analyze` reads the files themselves.

CREATE TABLE IF NOT EXISTS flight_recorder_dumps
(
    job String,
    node String,
    rank Int32,
    ts DateTime('UTC'),
    ts_ms Int64,
    capture_id String,
    trigger String,
    pid UInt32,
    fr_version String,
    groups_json String,
    entries_json String,
    entry_count UInt32,
    dropped Int64,
    error String
)
ENGINE = ReplacingMergeTree()
PARTITION BY toDate(ts)
ORDER BY (job, trigger, capture_id, rank, ts_ms);
