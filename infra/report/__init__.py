"""The HTML postmortem report of a job (``trainguard report``): :mod:`.data` reads it from
ClickHouse through the named queries, :mod:`.render` writes one self-contained HTML file."""
