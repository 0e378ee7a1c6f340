"""Pure detection logic: rule tables, training-signal and metric anomaly detectors, the
over-eviction classifier and planning helpers.  No Kafka, ClickHouse or Faust in here."""
