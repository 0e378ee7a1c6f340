"""Event schemas, the topic registry and the job topology: defined once, versioned, shared by
the exporters, the Faust workers, the ClickHouse sink and the action service.  Stdlib only
(PyYAML is imported lazily by the config loader)."""
