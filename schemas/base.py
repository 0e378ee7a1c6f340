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
    if not cls.TYPE:
        raise TypeError(f"{cls.__name__} has no TYPE")
    if cls.TYPE in EVENT_TYPES and EVENT_TYPES[cls.TYPE] is not cls:
        raise TypeError(f"event type {cls.TYPE!r} registered twice")
    EVENT_TYPES[cls.TYPE] = cls
    return cls
