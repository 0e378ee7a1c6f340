"""Bytes <-> events: the one wire codec shared by producers, Faust agents and the sink.

Wire format: one UTF-8 JSON object per Kafka record, the event's fields plus ``schema`` (the
event's ``TYPE``) and ``version``.  Non-finite floats are written as the JSON extensions
``NaN``/``Infinity`` (Python's ``json`` reads them back), because a NaN loss must survive the trip.

:func:`decode` is total: for every input it returns a valid event or raises :class:`DecodeError`
-- never anything else -- whose ``reason`` is short, printable and precise enough for a
dead-letter record: not bytes, too large, not UTF-8, not JSON (integers of more than 4300 digits
included), nested too deeply, unknown schema, unknown version, wrong type for this topic, or the
first field that failed validation (with its path; a job or node name that is no name, see
``trainguard.schemas.names``, too).  An event that decodes also encodes again
(no lone surrogates), and its values fit the ClickHouse columns they are stored in (every field's
``bounds``; see ``trainguard.schemas.limits``).

>>> from trainguard.schemas.workload import TrainingStep
>>> ev = TrainingStep(job="j", rank=0, step=7, ts_ms=1, loss=float("nan"))
>>> decode(encode(ev)).loss
nan
>>> decode(b'{"schema": "training_step", "version": 1, "job": "j", "rank": -3, "step": 1, "ts_ms": 1}')
Traceback (most recent call last):
...
trainguard.schemas.codec.DecodeError: training_step.rank: -3 is below the minimum 0
>>> decode(b'{"schema": "decision", "version": 1, "decision_id": "\\\\ud800", "ts_ms": 1, "job": "j"}')
Traceback (most recent call last):
...
trainguard.schemas.codec.DecodeError: decision.decision_id: string holds a lone surrogate U+D800 at ...
>>> decode(b'{"schema": "decision", "version": 1, "decision_id": "d", "ts_ms": 1, "job": "../x"}')
Traceback (most recent call last):
...
trainguard.schemas.codec.DecodeError: decision.job: name '../x' holds '/' at character 2 (allowed: ...)
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import orjson

from trainguard.schemas import control, telemetry, workload  # noqa: F401  (registers the event types)
from trainguard.schemas.base import EVENT_TYPES, LOCAL_TYPES, Event
from trainguard.schemas.typecheck import SchemaError, from_mapping, show, show_text, to_plain

#: Larger records are refused before parsing (a runaway producer must not OOM a worker).  The
#: largest topic limit is 8 MiB (stack dumps, ``trainguard.schemas.topics``), the producer's 16 MiB.
MAX_RECORD_BYTES = 16 * 1024 * 1024
#: Deepest nesting of JSON arrays/objects accepted (the top-level object is depth 1).  Typed
#: fields nest at most 5 deep (stack dump -> threads -> frame); the rest is for ``Any`` values
#: (detection evidence, decision evidence holding an over-eviction analysis: about 10 deep).
#: Bounding it keeps every later recursive walk (``to_plain``, ``json.dumps``) far from the
#: interpreter's recursion limit.
MAX_DEPTH = 64
_ENVELOPE = frozenset({"schema", "version"})
#: 19 digits in a row: maybe an integer orjson would not read exactly (see ``_quick_parse``);
#: found by mapping every digit to 0 and searching (a regex scan cost 60 us on a GPU batch).
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGITS = b"0" * 19
_NO_DATA: Any = object()

E = TypeVar("E", bound=Event)


class DecodeError(SchemaError):
    """The bytes are not a valid event; ``reason`` says exactly why."""


def to_dict(event: Event) -> dict[str, Any]:
    """The event as a plain mapping, with ``schema`` and ``version`` first."""
    body = to_plain(event)
    return {"schema": event.TYPE, "version": event.VERSION, **body}


def encode(event: Event) -> bytes:
    return json.dumps(to_dict(event), separators=(",", ":"), ensure_ascii=False).encode()


def from_dict(data: Any, expect: type[E] | None = None, local: bool = False) -> Event:
    """Validate a decoded mapping into its event class (upgrading older versions); ``local``: node-
    local events (:data:`~trainguard.schemas.base.LOCAL_TYPES`) are read too."""
    if not isinstance(data, dict):
        raise DecodeError("", f"expected a JSON object, got {type(data).__name__}")
    name = data.get("schema")
    if not isinstance(name, str):
        raise DecodeError("schema", "missing or not a string")
    cls = EVENT_TYPES.get(name) or (LOCAL_TYPES.get(name) if local else None)
    if cls is None:
        if name in LOCAL_TYPES:
            raise DecodeError("schema", f"{show(name)} is a node-local event, not read here")
        raise DecodeError("schema", f"unknown event type {show(name)}")
    if expect is not None and cls is not expect:
        raise DecodeError("schema", f"expected {expect.TYPE!r} on this topic, got {name!r}")
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise DecodeError("version", f"missing or not an integer: {show(version)}")
    body = {k: v for k, v in data.items() if k not in _ENVELOPE}
    if version != cls.VERSION:
        upgrade = cls.UPGRADES.get(version)
        if upgrade is None:
            known = sorted({cls.VERSION, *cls.UPGRADES})
            raise DecodeError(
                "version", f"unknown version {show(version)} of {name!r} (this build reads {known})"
            )
        try:
            body = upgrade(body)
        except Exception as exc:  # an upgrader meets an old record it cannot read
            raise DecodeError(
                "version", f"cannot upgrade version {version} of {name!r}: {_why(exc)}"
            ) from None
    try:
        return from_mapping(cls, body, path=name)
    except SchemaError as exc:
        raise DecodeError(exc.path, exc.reason) from None


def _why(exc: BaseException) -> str:
    return show_text(f"{type(exc).__name__}: {exc}", 300)


def _too_deep(data: Any, limit: int) -> bool:
    """Whether arrays/objects nest deeper than ``limit`` (walked without recursion)."""
    todo = [(data, 1)] if isinstance(data, dict | list) else []
    while todo:
        node, depth = todo.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, dict | list):
                todo.append((child, depth + 1))
    return False


def _parse(raw: Any) -> Any:
    if raw is None:
        raise DecodeError("", "empty record (null value / tombstone)")
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise DecodeError("", f"expected bytes, got {type(raw).__name__}")
    size = raw.nbytes if isinstance(raw, memoryview) else len(raw)
    if size > MAX_RECORD_BYTES:
        raise DecodeError("", f"record of {size} bytes exceeds {MAX_RECORD_BYTES}")
    buf = raw if isinstance(raw, bytes) else bytes(raw)
    data = _quick_parse(buf)
    if data is _NO_DATA:
        data = _exact_parse(buf)
    # Fewer opening brackets than the limit cannot nest deeper than it (most records: a scan in
    # C instead of a walk of every node in Python).
    if buf.count(b"[") + buf.count(b"{") > MAX_DEPTH and _too_deep(data, MAX_DEPTH):
        raise DecodeError("", f"not JSON: nested deeper than {MAX_DEPTH}")
    return data


def _quick_parse(buf: bytes) -> Any:
    """The common case in C (orjson checks UTF-8 and parses in one pass), or ``_NO_DATA`` for
    what the standard parser must read: NaN/Infinity, a lone surrogate escape, deep nesting,
    garbage (to name the error), and 19 digits in a row -- orjson reads an integer beyond 64
    bits as a float."""
    if buf.translate(_DIGITS_TO_ZERO).find(_LONG_DIGITS) >= 0:
        return _NO_DATA
    try:
        return orjson.loads(buf)
    except orjson.JSONDecodeError:
        return _NO_DATA


def _exact_parse(buf: bytes) -> Any:
    try:
        text = buf.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError("", f"not UTF-8 at byte {exc.start}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DecodeError("", f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise DecodeError("", f"not JSON: nested deeper than {MAX_DEPTH}") from None
    except ValueError as exc:  # an integer of more than 4300 digits (int_max_str_digits)
        raise DecodeError("", f"not JSON: {_why(exc)}") from None
    except MemoryError:
        raise DecodeError("", "not JSON: out of memory parsing the record") from None


def decode(
    raw: bytes | bytearray | memoryview | None, expect: type[E] | None = None, local: bool = False
) -> Event:
    """Parse one record's value; raise :class:`DecodeError` with the reason on any problem.
    ``local``: node-local events are read too (only a node's own socket asks for them).

    Total: any other exception (a bug) also becomes a :class:`DecodeError` (``internal error``)
    rather than escaping into a consumer loop; the tests assert no input ever gets there.
    """
    try:
        return from_dict(_parse(raw), expect, local)
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError("", f"internal error while decoding: {_why(exc)}") from None
