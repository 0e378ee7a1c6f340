"""Exporter sources, one file each; importing this package registers them all (in this order)."""

from streams.exporter.sources import (  # noqa: F401
    heartbeat,
    host,
    kernel_log,
    nic,
    nvml,
    process,
    reporter,
)
from streams.exporter.sources.base import REGISTRY, Source, SourceContext, enabled_sources, register

__all__ = ["REGISTRY", "Source", "SourceContext", "enabled_sources", "register"]
