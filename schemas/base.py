"""The event base class and the registry of event types by wire name and version.

Every event is a frozen dataclass subclassing :class:`Event` with two class-level constants:

* ``TYPE`` -- the wire name (``"gpu_batch"``); part of the contract, never renamed;
* ``VERSION`` -- the schema version this class reads and writes.

Registering an older version's upgrader (``UPGRADES = {1: upgrade_v1_to_v2}``) lets a consumer
read both during a rolling upgrade; any other version is rejected by the codec.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

#: wire name -> event class (latest version).
EVENT_TYPES: dict[str, type[Event]] = {}
#: wire name -> event class of the events that never leave their node (a launcher's word to its
#: node's exporter): no topic, no table, and the codec reads them only where a reader asks for
#: them (``decode(raw, local=True)``: the exporter's reporter socket), never from a topic.
LOCAL_TYPES: dict[str, type[Event]] = {}


def now_ms() -> int:
    """Wall-clock time in integer milliseconds since the epoch (the unit of every ``ts_ms``)."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class Event:
    """Base of all wire events; subclasses are registered by :func:`register`."""

    TYPE: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1
    #: older version -> function turning that version's field mapping into the current one.
    UPGRADES: ClassVar[dict[int, Callable[[dict[str, Any]], dict[str, Any]]]] = {}


E = TypeVar("E", bound=type["Event"])


def register(cls: E) -> E:
    """Class decorator adding an event class to :data:`EVENT_TYPES` (names must be unique)."""
    _check_unique(cls)
    EVENT_TYPES[cls.TYPE] = cls
    return cls


def register_local(cls: E) -> E:
    """Class decorator adding a node-local event class to :data:`LOCAL_TYPES`: one wire name space
    with :data:`EVENT_TYPES`, so a name means one thing wherever it is read."""
    _check_unique(cls)
    LOCAL_TYPES[cls.TYPE] = cls
    return cls


def _check_unique(cls: type[Event]) -> None:
    if not cls.TYPE:
        raise TypeError(f"{cls.__name__} has no TYPE")
    known = EVENT_TYPES.get(cls.TYPE) or LOCAL_TYPES.get(cls.TYPE)
    if known is not None and known is not cls:
        raise TypeError(f"event type {cls.TYPE!r} registered twice")
