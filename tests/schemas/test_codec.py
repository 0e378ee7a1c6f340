"""Wire codec: round trip of every registered event, and precise rejection of garbage."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.base import EVENT_TYPES, Event
from schemas.codec import DecodeError, decode, encode, to_dict
from schemas.control import Decision, Targets, decision_id
from schemas.enums import Action
from schemas.topics import TOPICS, topic_for
from schemas.workload import ProcessExit, TrainingStep
from tests.schemas.strategies import dataclass_strategy


def _same(a: object, b: object) -> bool:
    """Equality where NaN == NaN (a NaN loss must survive the round trip)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("cls", sorted(EVENT_TYPES.values(), key=lambda c: c.TYPE), ids=lambda c: c.TYPE)
@settings(
    max_examples=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], deadline=None
)
@given(data=st.data())
def test_round_trip_every_event_type(cls: type[Event], data: st.DataObject) -> None:
    try:
        event = data.draw(dataclass_strategy(cls))
    except ValueError:  # a drawn combination broke a cross-field rule: not a valid event
        return
    back = decode(encode(event), expect=cls)
    assert type(back) is cls
    assert _same(to_dict(back), to_dict(event))


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200))
def test_random_bytes_only_ever_raise_decode_error(raw: bytes) -> None:
    try:
        decode(raw)
    except DecodeError as exc:
        assert exc.reason


@settings(max_examples=200, deadline=None)
@given(
    doc=st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    )
)
def test_random_json_only_ever_raises_decode_error(doc: object) -> None:
    if isinstance(doc, dict):
        doc = {"schema": "training_step", "version": 1, **doc}
    try:
        decode(json.dumps(doc).encode())
    except DecodeError as exc:
        assert exc.reason


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\xff\xfe", "not UTF-8"),
        (b"{oops", "not JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (None, "empty record"),
        (b'{"version": 1}', "missing or not a string"),
        (b'{"schema": "gpu_batch_v9", "version": 1}', "unknown event type 'gpu_batch_v9'"),
        (b'{"schema": "gpu_batch", "version": 7}', "unknown version 7 of 'gpu_batch'"),
        (b'{"schema": "gpu_batch", "version": "1"}', "version: missing or not an integer"),
        (
            b'{"schema": "training_step", "version": 1, "job": "j", "step": 1, "ts_ms": 1}',
            "training_step.rank: is required",
        ),
        (
            b'{"schema": "training_step", "version": 1, "job": "j", "rank": 0, "step": 1, "ts_ms": 1, "mfu": 1.7}',
            "training_step.mfu: 1.7 is above the maximum 1",
        ),
        (
            b'{"schema": "training_step", "version": 1, "job": "j", "rank": 0, "step": 1, "ts_ms": 1, "x": 1}',
            "unknown field(s) 'x'",
        ),
        (
            b'{"schema": "gpu_batch", "version": 1, "node": "n", "ts_ms": 1, "gpus": [{"index": 0, "temperature_c": NaN}]}',
            "gpu_batch.gpus[0].temperature_c: non-finite value nan not allowed",
        ),
        (
            b'{"schema": "gpu_batch", "version": 1, "node": "n", "ts_ms": 1, "gpus": [{"index": 0, "state": "melted"}]}',
            "gpus[0].state: 'melted' is not one of: ok, lost, unavailable, no_driver",
        ),
        (
            b'{"schema": "process_exit", "version": 1, "node": "n", "ts_ms": 1, "pid": 3}',
            "needs an exit_code, a signal or a reason",
        ),
        (
            b'{"schema": "training_step", "version": 1, "job": "j", "rank": true, "step": 1, "ts_ms": 1}',
            "rank: expected an integer, got bool",
        ),
    ],
)
def test_garbage_is_rejected_with_a_precise_reason(raw: bytes | None, reason: str) -> None:
    with pytest.raises(DecodeError) as err:
        decode(raw)
    assert reason in str(err.value)


def test_wrong_type_for_topic_is_rejected() -> None:
    step = TrainingStep(job="j", rank=0, step=1, ts_ms=1)
    with pytest.raises(DecodeError, match="expected 'process_exit' on this topic, got 'training_step'"):
        decode(encode(step), expect=ProcessExit)


def test_oversized_record_is_rejected_before_parsing() -> None:
    with pytest.raises(DecodeError, match="exceeds"):
        decode(b" " * (16 * 1024 * 1024 + 1))


def test_nan_loss_survives_the_wire() -> None:
    back = decode(
        encode(TrainingStep(job="j", rank=1, step=2, ts_ms=3, loss=float("nan"), grad_norm=float("inf")))
    )
    assert isinstance(back, TrainingStep)
    assert back.loss is not None and math.isnan(back.loss)
    assert back.grad_norm == float("inf")


def test_older_versions_are_upgraded_when_an_upgrader_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    def v0_to_v1(body: dict[str, object]) -> dict[str, object]:
        body = dict(body)
        body["rank"] = body.pop("global_rank")
        return body

    monkeypatch.setattr(TrainingStep, "UPGRADES", {0: v0_to_v1})
    old = b'{"schema": "training_step", "version": 0, "job": "j", "global_rank": 4, "step": 1, "ts_ms": 1}'
    back = decode(old)
    assert isinstance(back, TrainingStep) and back.rank == 4


def test_decision_ids_are_deterministic_and_order_insensitive() -> None:
    a = decision_id("job", Action.EVICT, Targets(machines=["n2", "n1"], ranks=[3, 1]), 1000)
    b = decision_id("job", Action.EVICT, Targets(machines=["n1", "n2"], ranks=[1, 3]), 1000)
    c = decision_id("job", Action.EVICT, Targets(machines=["n1"], ranks=[1, 3]), 1000)
    assert a == b != c
    d = Decision(decision_id=a, ts_ms=1, job="job", action=Action.EVICT)
    assert decode(encode(d)) == d


def test_every_event_type_has_a_topic_and_keys_are_bytes() -> None:
    for cls in EVENT_TYPES.values():
        assert any(t.event is cls for t in TOPICS), cls.TYPE
    step = TrainingStep(job="job-7", rank=0, step=1, ts_ms=1)
    assert topic_for(step).key_of(step) == b"job-7"
