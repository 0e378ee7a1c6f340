"""Exporter sources, one file each; importing this package registers them all."""

from trainguard.streams.exporter.sources import heartbeat, host, kernel_log, nic, nvml, process, reporter  # noqa: F401
from trainguard.streams.exporter.sources.base import (
    REGISTRY,
    Source,
    SourceContext,
    enabled_sources,
    register,
)

__all__ = ["REGISTRY", "Source", "SourceContext", "enabled_sources", "register"]
