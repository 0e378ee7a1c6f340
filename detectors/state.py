"""Detector state as JSON: what a stream worker writes to its changelog and reads back after a
restart or a rebalance.

Detectors are plain objects (dicts, deques, floats); :func:`dump` turns one into a JSON document
and :func:`load` turns the document back into an object of the same classes.  Only the classes
named in :data:`ALLOWED` are ever built from a document, and only by setting their attributes
(``object.__new__`` + ``__dict__``; a dataclass through its constructor, which validates): no
code named by the document runs.  That is why
this is not ``pickle``: a changelog is a Kafka topic, and whoever can produce to it would
otherwise run code in every worker that restores from it.

Configuration objects (``*Config`` dataclasses) are not stored: a restored detector is given the
worker's current configuration (:meth:`trainguard.detectors.routing.DetectionPath.reconfigure`), the same
as a threshold changed at runtime.

>>> from trainguard.detectors.windows import WindowCounter
>>> w = WindowCounter(window_s=300)
>>> _ = w.observe(10.0)
>>> back = load(dump(w))
>>> back.observe(100.0), type(back).__name__
(2, 'WindowCounter')
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections import OrderedDict, deque
from typing import Any

import orjson

from trainguard.detectors.capture import Capture
from trainguard.detectors.exit_settle import ExitSettler
from trainguard.detectors.liveness import SilentMachineDetector
from trainguard.detectors.stopped_job import RecoveryStatus, StoppedJobDetector
from trainguard.detectors.training import (
    MfuDeclineDetector,
    SpikeDetector,
    StepStallDetector,
    StragglerDetector,
)
from trainguard.detectors.windows import WindowCounter
from trainguard.schemas.base import Event
from trainguard.schemas.codec import decode as decode_event
from trainguard.schemas.codec import encode as encode_event
from trainguard.schemas.control import Detection
from trainguard.schemas.enums import Action, ProcessRole, Severity
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.workload import StackDump

#: the classes a document may build, by name (nothing else is ever instantiated from one).
ALLOWED: dict[str, type[Any]] = {
    c.__name__: c
    for c in (
        WindowCounter,
        SpikeDetector,
        StepStallDetector,
        SilentMachineDetector,
        StragglerDetector,
        MfuDeclineDetector,
        StoppedJobDetector,
        ExitSettler,
        RecoveryStatus,
        Capture,
        JobTopology,
    )
}
ENUMS: dict[str, type[enum.Enum]] = {c.__name__: c for c in (Action, Severity, ProcessRole)}
#: schema events kept inside detector state (encoded with the wire codec, validated on load).
EVENTS: dict[str, type[Event]] = {c.__name__: c for c in (StackDump, Detection)}
#: the document format; a document of another version is refused, not guessed at.
VERSION = 1
#: nesting bound on documents: state is a few levels deep; a deeper document is not ours.
MAX_DEPTH = 32


class StateError(ValueError):
    """A state document that cannot be restored (garbage, another version, a class not allowed)."""


def dump(obj: Any) -> str:
    """``obj`` as a JSON document (see the module docstring for what may be in it)."""
    doc = {"v": VERSION, "s": _enc(obj, 0)}
    try:
        # orjson: a 10,000-rank job's monitor is half a megabyte, written every flush; the
        # standard encoder took ten times as long.  Non-finite floats never get here (tagged).
        return orjson.dumps(doc).decode()
    except TypeError:  # an int beyond 64 bits: the standard encoder writes those
        return json.dumps(doc, separators=(",", ":"), allow_nan=False)


def load(doc: str | bytes) -> Any:
    """The object a :func:`dump` document describes; :class:`StateError` for anything else."""
    try:
        data = orjson.loads(doc)
    except orjson.JSONDecodeError:
        try:  # what orjson refuses and the standard parser reads (ints beyond 64 bits)
            data = json.loads(doc)
        except (ValueError, RecursionError) as exc:
            raise StateError(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("v") != VERSION or "s" not in data:
        raise StateError(f"not a version-{VERSION} state document")
    try:
        return _dec(data["s"], 0)
    except StateError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as exc:
        raise StateError(f"malformed state: {type(exc).__name__}: {exc}") from None


def _is_config(v: Any) -> bool:
    return dataclasses.is_dataclass(v) and not isinstance(v, type) and type(v).__name__.endswith("Config")


_SIMPLE = frozenset({int, str, bool, type(None)})


def _all_plain(values: Any) -> bool:
    """Whether JSON keeps every item of ``values`` as it is (ints, strings, bools, None, finite
    floats; not enums), checked in C where it can be: a job's per-rank maps hold ten thousand
    items and are written with every flush."""
    kinds = set(map(type, values))
    if kinds <= _SIMPLE:
        return True
    if float in kinds and kinds <= _SIMPLE | {float}:
        return all(map(math.isfinite, [x for x in values if type(x) is float]))
    return False


def _enc(v: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise StateError("state nested too deeply")
    d = depth + 1
    if v is None or isinstance(v, bool | str):
        return v
    if isinstance(v, enum.Enum):
        return {"$e": type(v).__name__, "v": v.value}
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"$f": repr(v)}
    if isinstance(v, list):
        return list(v) if _all_plain(v) else [_enc(x, d) for x in v]
    if isinstance(v, tuple):
        return {"$t": [_enc(x, d) for x in v]}
    if isinstance(v, set | frozenset):
        return {"$s": [_enc(x, d) for x in sorted(v, key=repr)]}
    if isinstance(v, deque):
        return {"$q": list(v) if _all_plain(v) else [_enc(x, d) for x in v], "max": v.maxlen}
    if isinstance(v, dict):
        ordered = isinstance(v, OrderedDict)
        if _all_plain(v.keys()) and _all_plain(v.values()):
            # rank -> step: two columns, built in C (pairs cost a list per item)
            return {"$oc" if ordered else "$dc": list(v.keys()), "v": list(v.values())}
        return {"$o" if ordered else "$d": [[_enc(k, d), _enc(x, d)] for k, x in v.items()]}
    name = type(v).__name__
    if name in EVENTS and isinstance(v, EVENTS[name]):
        return {"$ev": encode_event(v).decode()}
    if name in ALLOWED and isinstance(v, ALLOWED[name]):
        # STATE_SKIP: attributes the class rebuilds by itself (a window that refills in seconds),
        # too big to rewrite with every flush.
        skip = getattr(type(v), "STATE_SKIP", ())
        attrs = {k: _enc(x, d) for k, x in vars(v).items() if k not in skip and not _is_config(x)}
        return {"$c": name, "a": attrs}
    raise StateError(f"cannot store a {name} in detector state")


def _all_json_plain(values: list[Any]) -> bool:
    return set(map(type, values)) <= _SIMPLE | {float}


def _dec(v: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise StateError("state nested too deeply")
    d = depth + 1
    if v is None or isinstance(v, bool | str | int | float):
        return v
    if isinstance(v, list):
        return [_dec(x, d) for x in v]
    if not isinstance(v, dict) or len(v) > 2:
        raise StateError(f"unexpected {type(v).__name__} in state")
    if "$f" in v:
        f = float(v["$f"])
        if math.isfinite(f):
            raise StateError("a tagged float must be inf or nan")
        return f
    if "$e" in v:
        cls = ENUMS.get(v["$e"])
        if cls is None:
            raise StateError(f"enum {v['$e']!r} not allowed in state")
        return cls(v["v"])
    if "$t" in v:
        return tuple(_dec(x, d) for x in v["$t"])
    if "$s" in v:
        return {_dec(x, d) for x in v["$s"]}
    if "$q" in v:
        maxlen = v.get("max")
        if maxlen is not None and (not isinstance(maxlen, int) or maxlen < 0):
            raise StateError("bad deque bound")
        return deque((_dec(x, d) for x in v["$q"]), maxlen=maxlen)
    if "$dc" in v or "$oc" in v:
        keys, values = v.get("$dc", v.get("$oc")), v.get("v")
        if not isinstance(keys, list) or not isinstance(values, list) or len(keys) != len(values):
            raise StateError("a columnar map needs two lists of one length")
        if not _all_json_plain(keys) or not _all_json_plain(values):
            raise StateError("a columnar map holds only plain values")
        columns = zip(keys, values, strict=True)
        return OrderedDict(columns) if "$oc" in v else dict(columns)
    if "$d" in v or "$o" in v:
        pairs = [(_dec(k, d), _dec(x, d)) for k, x in (v.get("$d") or v.get("$o") or [])]
        return OrderedDict(pairs) if "$o" in v else dict(pairs)
    if "$ev" in v:
        name = next(iter(EVENTS))
        ev = decode_event(str(v["$ev"]).encode())
        if not isinstance(ev, tuple(EVENTS.values())):
            raise StateError(f"event {type(ev).__name__} not allowed in state (only {name})")
        return ev
    if "$c" in v:
        cls = ALLOWED.get(v["$c"])
        if cls is None:
            raise StateError(f"class {v['$c']!r} not allowed in state")
        attrs = v.get("a")
        if not isinstance(attrs, dict):
            raise StateError("class state without attributes")
        values = {str(k): _dec(x, d) for k, x in attrs.items()}
        if dataclasses.is_dataclass(cls):  # through the constructor: it validates (a topology's sizes)
            return cls(**values)
        obj = object.__new__(cls)
        obj.__dict__.update(values)
        return obj
    raise StateError(f"unknown state tag in {sorted(v)}")
