"""The compiled fast checker (``trainguard.schemas.typecheck._fast``) next to the general path it shortcuts.

For every event type, valid events and hostile documents are decoded twice: as the codec does
(fast checker first) and with the fast checker switched off (every value through ``convert``).
Both must give the same event -- same classes, same value types -- or the same error.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainguard.schemas.typecheck as tc
from tests.schemas.strategies import dataclass_strategy, hostile_document
from trainguard.schemas.base import EVENT_TYPES, Event
from trainguard.schemas.codec import DecodeError, _parse, encode, from_dict
from trainguard.schemas.telemetry import GpuSample, GpuSampleBatch, GpuState

EVENTS = sorted(EVENT_TYPES.values(), key=lambda c: c.TYPE)
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]


@contextmanager
def general_path_only() -> Iterator[None]:
    with mock.patch.object(tc, "_fast", lambda cls: lambda data: tc._MISS):
        yield


def outcome(data: Any, cls: type[Event]) -> tuple[str, str]:
    """What decoding ``data`` gives: ("ok", a repr that shows every value's type) or ("error", ...)."""
    try:
        ev = from_dict(data, cls)
    except DecodeError as exc:
        return "error", str(exc)
    return "ok", _typed_repr(ev)


def _typed_repr(v: Any) -> str:
    if isinstance(v, list | tuple):
        return f"{type(v).__name__}[{', '.join(map(_typed_repr, v))}]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_typed_repr(k)}: {_typed_repr(x)}" for k, x in v.items()) + "}"
    if hasattr(v, "__dataclass_fields__"):
        return f"{type(v).__name__}({', '.join(f'{k}={_typed_repr(x)}' for k, x in vars(v).items())})"
    return f"{type(v).__name__}:{v!r}"


def assert_same_both_ways(data: Any, cls: type[Event]) -> None:
    fast = outcome(data, cls)
    with general_path_only():
        general = outcome(data, cls)
    assert fast == general


@pytest.mark.parametrize("cls", EVENTS, ids=lambda c: c.TYPE)
@settings(max_examples=30, suppress_health_check=_SLOW_OK, deadline=None)
@given(data=st.data())
def test_valid_events_decode_the_same_both_ways(cls: type[Event], data: st.DataObject) -> None:
    try:
        event = data.draw(dataclass_strategy(cls))
    except ValueError:  # a drawn combination broke a cross-field rule: not a valid event
        return
    assert_same_both_ways(_parse(encode(event)), cls)


@pytest.mark.parametrize("cls", EVENTS, ids=lambda c: c.TYPE)
@settings(max_examples=30, suppress_health_check=_SLOW_OK, deadline=None)
@given(data=st.data())
def test_hostile_documents_decode_the_same_both_ways(cls: type[Event], data: st.DataObject) -> None:
    try:
        doc = _parse(data.draw(hostile_document(cls)))
    except DecodeError:
        return  # not JSON: the checkers never see it
    assert_same_both_ways(doc, cls)


def _gpu_doc(**gpu: Any) -> dict[str, Any]:
    return {"schema": "gpu_batch", "version": 1, "node": "n1", "ts_ms": 5, "gpus": [{"index": 0, **gpu}]}


@pytest.mark.parametrize(
    "gpu",
    [
        {},
        {"temperature_c": 61},  # an int in a float field: converted to 61.0
        {"temperature_c": 10**400},
        {"temperature_c": -(10**301)},
        {"mem_used_bytes": 2**64 - 1},
        {"temperature_c": float("nan")},
        {"temperature_c": float("inf")},
        {"temperature_c": 201.0},
        {"power_w": -0.0},
        {"index": True},
        {"index": 1024},
        {"index": 2.0},
        {"state": "lost"},
        {"state": "LOST"},
        {"state": GpuState.LOST},
        {"uuid": "\ud800"},
        {"uuid": "é" * 256},
        {"uuid": "é" * 257},
        {"throttle_reasons": ["a", "\udfff"]},
        {"throttle_reasons": ["a"] * 65},
        {"throttle_reasons": ["x" * 257]},
        {"throttle_reasons": [1]},
        {"throttle_reasons": ("a",)},
        {"retired_pages_pending": 1},
        {"mem_used_bytes": 2**64},
        {"unknown": 1},
    ],
    ids=repr,
)
def test_edge_values_decode_the_same_both_ways(gpu: dict[str, Any]) -> None:
    assert_same_both_ways(_gpu_doc(**gpu), GpuSampleBatch)


def test_the_fast_checker_fills_defaults_and_builds_equal_frozen_objects() -> None:
    ev = from_dict(_gpu_doc(temperature_c=60.0), GpuSampleBatch)
    assert isinstance(ev, GpuSampleBatch)
    assert ev.gpus == [GpuSample(index=0, temperature_c=60.0)]
    with pytest.raises(AttributeError):
        ev.gpus[0].index = 3  # type: ignore[misc]  # still frozen
    a = from_dict(_gpu_doc(), GpuSampleBatch)
    b = from_dict(_gpu_doc(), GpuSampleBatch)
    assert isinstance(a, GpuSampleBatch) and isinstance(b, GpuSampleBatch)
    assert a.gpus[0].throttle_reasons is not b.gpus[0].throttle_reasons  # a fresh default list each


def test_the_fast_checker_vouches_for_the_common_case() -> None:
    """Not a fallback in disguise: a healthy GPU batch is built by the compiled checker alone."""
    doc = _gpu_doc(temperature_c=60.0, power_w=600.0, util_gpu_pct=97.0, mem_used_bytes=1)
    body = {k: v for k, v in doc.items() if k not in ("schema", "version")}
    assert tc._fast(GpuSampleBatch)(body) is not tc._MISS
    assert tc._fast(GpuSampleBatch)({**body, "ts_ms": -1}) is tc._MISS
