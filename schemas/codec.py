"""Bytes <-> events: the one wire codec shared by producers, Faust agents and the sink.

Wire format: one UTF-8 JSON object per Kafka record, the event's fields plus ``schema`` (the
event's ``TYPE``) and ``version``.  Non-finite floats are written as the JSON extensions
``NaN``/``Infinity`` (Python's ``json`` reads them back), because a NaN loss must survive the trip.

:func:`decode` never raises anything but :class:`DecodeError`, whose ``reason`` is precise
enough for a dead-letter record: not UTF-8, not JSON, unknown schema, unknown version, wrong
type for this topic, or the first field that failed validation (with its path).

>>> from schemas.workload import TrainingStep
>>> ev = TrainingStep(job="j", rank=0, step=7, ts_ms=1, loss=float("nan"))
>>> decode(encode(ev)).loss
nan
>>> decode(b'{"schema": "training_step", "version": 1, "job": "j", "rank": -3, "step": 1, "ts_ms": 1}')
Traceback (most recent call last):
...
schemas.codec.DecodeError: training_step.rank: -3 is below the minimum 0
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from schemas import control, telemetry, workload  # noqa: F401  (registers the event types)
from schemas.base import EVENT_TYPES, Event
from schemas.typecheck import SchemaError, from_mapping, to_plain

#: Larger records are refused before parsing (a runaway producer must not OOM a worker).
MAX_RECORD_BYTES = 16 * 1024 * 1024
_ENVELOPE = frozenset({"schema", "version"})

E = TypeVar("E", bound=Event)


class DecodeError(SchemaError):
    """The bytes are not a valid event; ``reason`` says exactly why."""


def to_dict(event: Event) -> dict[str, Any]:
    """The event as a plain mapping, with ``schema`` and ``version`` first."""
    body = to_plain(event)
    return {"schema": event.TYPE, "version": event.VERSION, **body}


def encode(event: Event) -> bytes:
    return json.dumps(to_dict(event), separators=(",", ":"), ensure_ascii=False).encode()


def from_dict(data: Any, expect: type[E] | None = None) -> Event:
    """Validate a decoded mapping into its event class (upgrading older versions)."""
    if not isinstance(data, dict):
        raise DecodeError("", f"expected a JSON object, got {type(data).__name__}")
    name = data.get("schema")
    if not isinstance(name, str):
        raise DecodeError("schema", "missing or not a string")
    cls = EVENT_TYPES.get(name)
    if cls is None:
        raise DecodeError("schema", f"unknown event type {name!r}")
    if expect is not None and cls is not expect:
        raise DecodeError("schema", f"expected {expect.TYPE!r} on this topic, got {name!r}")
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise DecodeError("version", f"missing or not an integer: {version!r}")
    body = {k: v for k, v in data.items() if k not in _ENVELOPE}
    if version != cls.VERSION:
        upgrade = cls.UPGRADES.get(version)
        if upgrade is None:
            known = sorted({cls.VERSION, *cls.UPGRADES})
            raise DecodeError("version", f"unknown version {version} of {name!r} (this build reads {known})")
        body = upgrade(body)
    try:
        return from_mapping(cls, body, path=name)
    except SchemaError as exc:
        raise DecodeError(exc.path, exc.reason) from None


def decode(raw: bytes | bytearray | memoryview | None, expect: type[E] | None = None) -> Event:
    """Parse one record's value; raise :class:`DecodeError` with the reason on any problem."""
    if raw is None:
        raise DecodeError("", "empty record (null value / tombstone)")
    if len(raw) > MAX_RECORD_BYTES:
        raise DecodeError("", f"record of {len(raw)} bytes exceeds {MAX_RECORD_BYTES}")
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError("", f"not UTF-8 at byte {exc.start}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DecodeError("", f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise DecodeError("", "not JSON: nested too deeply") from None
    return from_dict(data, expect)
