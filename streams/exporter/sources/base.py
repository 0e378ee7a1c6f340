"""The one small ``Source`` protocol and the registry of sources by name.

Like node_exporter's ``registerCollector(name, defaultEnabled, factory)``: each source file calls
:func:`register` once; the runner builds the sources enabled in the config section of the same
name.  A source's ``collect()`` returns events or raises; the runner turns an exception into a
heartbeat entry (never a crash), so a source never needs to guard its own I/O globally -- only
where a partial result is worth more than none (one unreadable interface among many).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from trainguard.schemas.base import Event
from trainguard.schemas.telemetry import SourceHealth
from trainguard.schemas.workload import NODE_LOG_SOURCES
from trainguard.streams.exporter.config import ExporterConfig
from trainguard.streams.exporter.ranks import RankRegistry

#: the ``source`` of the lines the exporter's own sources read from the kernel (``kernel_log``)
#: and of NVML's Xid events (``nvml``).  A training process may not claim them (the ``reporter``
#: source refuses it), so a line with one is the node's own: spooled last
#: (``trainguard.streams.exporter.delivery.SpoolPriority``) and the only kind the rule table's
#: ``origin: node`` rows fire on.
KERNEL_SOURCES = NODE_LOG_SOURCES


class Source(Protocol):
    """Something the exporter samples periodically."""

    name: str

    def collect(self) -> list[Event]:
        """One round: the events to publish (may be empty); raise on failure."""
        ...

    def close(self) -> None:
        """Release files, sockets, NVML (called once when the exporter stops)."""
        ...


@dataclass(frozen=True)
class Watching:
    """What a source watched in its latest round and what it skipped, with why (the heartbeat
    reports it: the ``nic`` source's interfaces)."""

    watched: tuple[str, ...] = ()
    #: (name, reason) pairs.
    skipped: tuple[tuple[str, str], ...] = ()


def _uncounted(reason: str, n: int) -> None:
    """A context built outside the runner (a test building a source) counts its drops nowhere."""


@dataclass
class SourceContext:
    """What a source factory gets: the config, the node's identity and the runner's hooks."""

    cfg: ExporterConfig
    #: where sources may keep state across restarts (None: stateless, e.g. ``--once``).
    state_dir: Path | None = None
    #: the runner's view of every source's health (the heartbeat source reports it).
    health: Callable[[], list[SourceHealth]] = list
    #: an NVML implementation to use instead of pynvml (tests, benches, simulated machines).
    nvml: Any = None
    #: True for ``--once``: sources must not persist positions.
    once: bool = False
    #: ``dropped(reason, n)``: a source lost ``n`` records it took in (the exporter's metrics).
    dropped: Callable[[str, int], None] = _uncounted
    #: the ranks launchers registered (the reporter source files them, the process source follows
    #: them); one per exporter, shared with its stack and Flight Recorder captures.
    ranks: RankRegistry = field(default_factory=RankRegistry)
    #: source name -> what it watched in its latest round (replaced whole each round, so the
    #: heartbeat's thread reads a consistent value).
    watching: dict[str, Watching] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def node(self) -> str:
        return self.cfg.node_name

    @property
    def job(self) -> str:
        return self.cfg.job


SourceFactory = Callable[[SourceContext], Source]


@dataclass(frozen=True)
class Registration:
    name: str
    factory: SourceFactory


#: name -> registration.
REGISTRY: dict[str, Registration] = {}
#: sources that report on the others run last in a round (``--once`` shows this round's health).
LAST = ("heartbeat",)


def register(name: str) -> Callable[[SourceFactory], SourceFactory]:
    """Decorator for a source factory; ``name`` is also its config section."""

    def deco(factory: SourceFactory) -> SourceFactory:
        if name in REGISTRY:
            raise ValueError(f"source {name!r} registered twice")
        if (
            not hasattr(ExporterConfig, "__dataclass_fields__")
            or name not in ExporterConfig.__dataclass_fields__
        ):
            raise ValueError(f"source {name!r} has no config section in ExporterConfig")
        REGISTRY[name] = Registration(name, factory)
        return factory

    return deco


def section(cfg: ExporterConfig, name: str) -> Any:
    """The config section of source ``name`` (has ``enabled`` and ``interval_s``)."""
    return getattr(cfg, name)


def enabled_sources(cfg: ExporterConfig) -> list[str]:
    """Enabled source names, alphabetical, with :data:`LAST` at the end."""
    names = sorted(name for name in REGISTRY if section(cfg, name).enabled)
    return sorted(names, key=lambda n: n in LAST)


def read_text(path: Path) -> str:
    """A small sysfs/procfs file, stripped (sysfs values end in a newline)."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read().strip()
