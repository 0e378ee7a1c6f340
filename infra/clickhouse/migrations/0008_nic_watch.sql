-- What each exporter's nic source watches (#36): a sample of an interface its exporter has never
-- seen up (never_up: a port never cabled, one left unused; not a fault), and on the exporter's
-- heartbeats the interfaces watched and those skipped with why (each list bounded, with totals).
-- Rows written before read 0 / empty: every interface had been up, as the exporters then meant.

ALTER TABLE nic_samples ADD COLUMN never_up UInt8;

ALTER TABLE heartbeats
    ADD COLUMN nics_watched Array(String),
    ADD COLUMN nics_watched_total UInt64,
    ADD COLUMN nics_skipped_names Array(String),
    ADD COLUMN nics_skipped_reasons Array(String),
    ADD COLUMN nics_skipped_total UInt64;
