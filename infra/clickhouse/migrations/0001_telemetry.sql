-- Machine telemetry from the node exporters. Daily partitions: retention drops whole days
-- (ALTER TABLE ... DROP PARTITION), since 18.16 has no TTL.
-- ReplacingMergeTree on the natural key: a redelivered or replayed sample collapses into one
-- row at merge time; postmortem queries read with FINAL (or GROUP BY the key) to be exact.

CREATE TABLE IF NOT EXISTS gpu_samples
(
    node String,
    job String,
    ts DateTime('UTC'),
    ts_ms Int64,
    gpu UInt16,
    uuid String,
    state String,
    util_gpu_pct Nullable(Float32),
    util_mem_pct Nullable(Float32),
    mem_used_bytes Nullable(UInt64),
    mem_total_bytes Nullable(UInt64),
    temperature_c Nullable(Float32),
    power_w Nullable(Float32),
    sm_clock_mhz Nullable(UInt32),
    throttle_mask Nullable(UInt64),
    throttle_reasons Array(String),
    ecc_volatile_corrected Nullable(UInt64),
    ecc_volatile_uncorrected Nullable(UInt64),
    ecc_aggregate_corrected Nullable(UInt64),
    ecc_aggregate_uncorrected Nullable(UInt64),
    retired_pages_pending Nullable(UInt8),
    remapped_rows_correctable Nullable(UInt64),
    remapped_rows_uncorrectable Nullable(UInt64),
    remap_pending Nullable(UInt8),
    remap_failure Nullable(UInt8),
    pcie_replay_count Nullable(UInt64),
    nvlink_errors Nullable(UInt64),
    error String
)
ENGINE = ReplacingMergeTree()
PARTITION BY toDate(ts)
ORDER BY (node, gpu, ts_ms);

CREATE TABLE IF NOT EXISTS host_samples
(
    node String,
    job String,
    ts DateTime('UTC'),
    ts_ms Int64,
    cpu_util_pct Float32,
    load1 Float32,
    load5 Float32,
    load15 Float32,
    mem_total_bytes UInt64,
    mem_available_bytes UInt64,
    swap_total_bytes UInt64,
    swap_used_bytes UInt64,
    process_count UInt32,
    disk_mounts Array(String),
    disk_total_bytes Array(UInt64),
    disk_used_bytes Array(UInt64)
)
ENGINE = ReplacingMergeTree()
PARTITION BY toDate(ts)
ORDER BY (node, ts_ms);

CREATE TABLE IF NOT EXISTS nic_samples
(
    node String,
    job String,
    ts DateTime('UTC'),
    ts_ms Int64,
    nic String,
    kind String,
    operstate String,
    carrier Nullable(UInt8),
    carrier_changes Nullable(UInt64),
    rx_bytes Nullable(UInt64),
    tx_bytes Nullable(UInt64),
    rx_errors Nullable(UInt64),
    tx_errors Nullable(UInt64),
    rx_dropped Nullable(UInt64),
    tx_dropped Nullable(UInt64),
    counter_names Array(String),
    counter_values Array(UInt64)
)
ENGINE = ReplacingMergeTree()
PARTITION BY toDate(ts)
ORDER BY (node, nic, ts_ms);

CREATE TABLE IF NOT EXISTS heartbeats
(
    node String,
    component String,
    job String,
    ts DateTime('UTC'),
    ts_ms Int64,
    seq UInt64,
    source_names Array(String),
    source_ok Array(UInt8),
    source_errors Array(UInt64),
    sources_json String
)
ENGINE = ReplacingMergeTree()
PARTITION BY toDate(ts)
ORDER BY (node, component, ts_ms);
