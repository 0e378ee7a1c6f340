"""Wire codec: round trip of every registered event, precise rejection of garbage, and totality:
for any input at all, ``decode`` returns a valid event (which encodes again and round-trips) or
raises ``DecodeError`` -- never anything else."""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any, Union

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.schemas.strategies import CHARS, HOSTILE_VALUES, dataclass_strategy, hostile_document
from trainguard.schemas.base import EVENT_TYPES, Event
from trainguard.schemas.codec import MAX_DEPTH, MAX_RECORD_BYTES, DecodeError, decode, encode, to_dict
from trainguard.schemas.control import Decision, Targets, decision_id
from trainguard.schemas.enums import Action
from trainguard.schemas.limits import MAX_TS_MS
from trainguard.schemas.telemetry import NicSample, NicSampleBatch
from trainguard.schemas.topics import TOPICS, topic_for
from trainguard.schemas.workload import ProcessExit, TrainingStep

EVENTS = sorted(EVENT_TYPES.values(), key=lambda c: c.TYPE)
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]


def _same(a: object, b: object) -> bool:
    """Equality where NaN == NaN (a NaN loss must survive the round trip)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def assert_total(raw: Any) -> Event | None:
    """``decode(raw)``: a valid event that encodes again and round-trips, or a DecodeError whose
    reason is short, printable UTF-8 (it goes into a dead letter); None for the latter."""
    try:
        event = decode(raw)
    except DecodeError as exc:
        assert exc.reason
        assert "internal error" not in exc.reason, exc.reason  # a guard caught what a check missed
        assert len(str(exc)) < 3000, str(exc)[:200]
        str(exc).encode("utf-8")  # no lone surrogate in a reason
        return None
    wire = encode(event)
    assert len(wire) <= MAX_RECORD_BYTES
    back = decode(wire)
    assert type(back) is type(event)
    assert _same(to_dict(back), to_dict(event))
    return event


@pytest.mark.parametrize("cls", EVENTS, ids=lambda c: c.TYPE)
@settings(max_examples=40, suppress_health_check=_SLOW_OK, deadline=None)
@given(data=st.data())
def test_round_trip_every_event_type(cls: type[Event], data: st.DataObject) -> None:
    try:
        event = data.draw(dataclass_strategy(cls))
    except ValueError:  # a drawn combination broke a cross-field rule: not a valid event
        return
    wire = encode(event)  # a valid event always encodes: no lone surrogate can be in it
    if len(wire) > MAX_RECORD_BYTES:  # every field within its bounds, the record too large
        with pytest.raises(DecodeError, match="exceeds"):
            decode(wire, expect=cls)
        return
    back = decode(wire, expect=cls)
    assert type(back) is cls
    assert _same(to_dict(back), to_dict(event))


@pytest.mark.parametrize("cls", EVENTS, ids=lambda c: c.TYPE)
@settings(max_examples=25, suppress_health_check=_SLOW_OK, deadline=None)
@given(data=st.data())
def test_hostile_documents_decode_to_valid_events_or_raise_decode_error(
    cls: type[Event], data: st.DataObject
) -> None:
    assert_total(data.draw(hostile_document(cls)))


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200) | st.builds(bytearray, st.binary(max_size=50)))
def test_random_bytes_only_ever_raise_decode_error(raw: bytes) -> None:
    assert_total(raw)
    assert_total(memoryview(raw))


_ANY_TEXT = st.text(CHARS | st.characters(categories=["Cs"]), max_size=8)


@settings(max_examples=200, deadline=None, suppress_health_check=_SLOW_OK)
@given(
    name=st.sampled_from([c.TYPE for c in EVENTS]),
    doc=st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | _ANY_TEXT | HOSTILE_VALUES,
        lambda c: st.lists(c, max_size=3) | st.dictionaries(_ANY_TEXT, c, max_size=4),
    ),
)
def test_random_json_only_ever_raises_decode_error(name: str, doc: object) -> None:
    if isinstance(doc, dict):
        doc = {"schema": name, "version": 1, **doc}
    try:
        raw = json.dumps(doc).encode()
    except (ValueError, RecursionError):  # json.dumps cannot write it (an int of 4300+ digits...)
        return
    assert_total(raw)


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


# -- totality: the inputs of issue #11, one by one -------------------------------------------------

_DECISION = (
    '{"schema":"decision","version":1,"decision_id":"d","ts_ms":1700000000000,"job":"j","action":"evict"'
)


def _raw(head: str, **fields: str) -> bytes:
    return (head + "".join(f',"{k}":{v}' for k, v in fields.items()) + "}").encode()


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        # a lone surrogate decoded, then failed later on encode()
        (_raw(_DECISION, reason='"\\ud800"'), "decision.reason: string holds a lone surrogate U+D800"),
        (_raw(_DECISION, reason='"ok \\udc00"'), "lone surrogate U+DC00 at character 3"),
        (_raw(_DECISION, detection_ids='["a", "\\udbff"]'), "decision.detection_ids[1]: string holds"),
        (_raw(_DECISION, evidence='{"x": ["\\ud800"]}'), "decision.evidence.x[0]: string holds"),
        (_raw(_DECISION, evidence='{"\\ud800": 1}'), "decision.evidence: object key holds a lone"),
        # a node name: the name rule says it (a surrogate is no letter), escaped
        (
            _raw(_DECISION, targets='{"machines": ["\\udfff"]}'),
            "decision.targets.machines[0]: name '\\udfff' holds",
        ),
        # a 4301-digit integer raised ValueError
        (_raw(_DECISION, evidence="9" * 4301), "not JSON: ValueError: Exceeds the limit (4300 digits)"),
        (_raw(_DECISION, ts_ms="-" + "9" * 4301), "not JSON: ValueError: Exceeds the limit"),
        # ranks beyond Array(Int32) passed the schema
        (
            _raw(_DECISION, targets=f'{{"ranks": [{2**40}]}}'),
            "decision.targets.ranks[0]: 1099511627776 is above",
        ),
        (_raw(_DECISION, targets='{"ranks": [-1]}'), "decision.targets.ranks[0]: -1 is below the minimum 0"),
        # a ts_ms in microseconds failed a later datetime conversion
        (
            _raw(_DECISION.replace("1700000000000", "1700000000000000")),
            f"decision.ts_ms: 1700000000000000 is above the maximum {MAX_TS_MS}",
        ),
        (_raw(_DECISION, ts_ms="-1"), "decision.ts_ms: -1 is below the minimum 0"),
        # NaN/Infinity literals where a field does not allow them; numbers beyond a float
        (_raw(_DECISION, ts_ms="NaN"), "decision.ts_ms: expected an integer, got float nan"),
        (_raw(_DECISION, ts_ms="1e400"), "decision.ts_ms: expected an integer, got float inf"),
        (
            _raw(_DECISION, ts_ms="1e300"),
            "decision.ts_ms: 1000000000000000052504760255...15669472196386865459400540160 is above the maximum",
        ),
        (
            b'{"schema":"host","version":1,"node":"n","ts_ms":1,"cpu_util_pct":' + b"9" * 400 + b"}",
            "host.cpu_util_pct: " + "9" * 28 + "..." + "9" * 29 + " is out of the float range",
        ),
        (
            b'{"schema":"host","version":1,"node":"n","ts_ms":1,"cpu_util_pct":-Infinity}',
            "host.cpu_util_pct: non-finite value -inf not allowed",
        ),
        # sizes
        (
            _raw(_DECISION, reason=json.dumps("x" * 65_537)),
            "decision.reason: string of 65537 characters exceeds",
        ),
        (
            _raw(_DECISION, targets=json.dumps({"ranks": [0] * (2**20 + 1)})),
            "decision.targets.ranks: 1048577 items exceed the maximum 1048576",
        ),
        # nesting
        (_raw(_DECISION, evidence="[" * 100_000 + "]" * 100_000), f"nested deeper than {MAX_DEPTH}"),
        (
            _raw(_DECISION, evidence='{"a":' * MAX_DEPTH + "0" + "}" * MAX_DEPTH),
            f"nested deeper than {MAX_DEPTH}",
        ),
        # not bytes at all
        ("{}", "expected bytes, got str"),
        (12, "expected bytes, got int"),
    ],
)
def test_issue_11_inputs_raise_decode_error(raw: Any, reason: str) -> None:
    with pytest.raises(DecodeError) as err:
        decode(raw)
    assert reason in str(err.value)
    assert_total(raw)


def test_nesting_up_to_the_limit_is_accepted() -> None:
    # The envelope object is depth 1 and evidence depth 2: the deepest evidence value fits exactly.
    inner = MAX_DEPTH - 2
    deep = _raw(_DECISION, evidence='{"a":' * inner + "{}" + "}" * inner)
    event = assert_total(deep)
    assert isinstance(event, Decision)


def test_a_bad_dict_key_is_shown_escaped_in_the_path() -> None:
    raw = (
        b'{"schema":"nic_batch","version":1,"node":"n","ts_ms":1,'
        b'"nics":[{"name":"ib0","counters":{"a b\\u0000\\ud800":1}}]}'
    )
    with pytest.raises(DecodeError, match=r"counters: object key holds a lone surrogate") as err:
        decode(raw)
    str(err.value).encode("utf-8")
    raw = b'{"schema":"nic_batch","version":1,"node":"n","ts_ms":1,"nics":[{"name":"ib0","counters":{"a b":-1}}]}'
    with pytest.raises(
        DecodeError, match=r"nic_batch\.nics\[0\]\.counters\['a b'\]: -1 is below the minimum 0"
    ):
        decode(raw)


def test_nic_counters_fit_uint64() -> None:
    ok = NicSampleBatch(node="n", ts_ms=1, nics=[NicSample(name="ib0", counters={"symbol_error": 2**64 - 1})])
    assert decode(encode(ok)) == ok
    bad = NicSampleBatch(node="n", ts_ms=1, nics=[NicSample(name="ib0", counters={"symbol_error": 2**64})])
    with pytest.raises(
        DecodeError, match=r"nics\[0\]\.counters\.symbol_error: 18446744073709551616 is above"
    ):
        decode(encode(bad))


def test_a_huge_document_is_refused_or_decoded_without_error() -> None:
    # Just under the record limit: 15 strings of 1 Mi characters (each at the evidence limit).
    evidence = {f"s{i}": "x" * 1_048_576 for i in range(15)}
    doc = _raw(_DECISION, evidence=json.dumps(evidence))
    assert MAX_RECORD_BYTES - 2**20 < len(doc) <= MAX_RECORD_BYTES
    assert isinstance(assert_total(doc), Decision)
    assert assert_total(doc + b" " * 2**20) is None  # one MiB more: refused before parsing
    # Every rank of the largest job (1 Mi) in one decision, the most a list of ranks may hold.
    ranks = _raw(_DECISION, targets=json.dumps({"ranks": [10_000_000] * 2**20}))
    decision = assert_total(ranks)
    assert isinstance(decision, Decision) and len(decision.targets.ranks) == 2**20


def test_an_upgrader_that_raises_is_a_decode_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def v0_to_v1(body: dict[str, object]) -> dict[str, object]:
        return {**body, "rank": body["global_rank"]}

    monkeypatch.setattr(TrainingStep, "UPGRADES", {0: v0_to_v1})
    with pytest.raises(DecodeError, match=r"version: cannot upgrade version 0 of 'training_step': KeyError"):
        decode(b'{"schema": "training_step", "version": 0, "job": "j", "step": 1, "ts_ms": 1}')


def test_reasons_stay_short_whatever_the_input() -> None:
    many = {f"f{i}": 1 for i in range(10_000)}
    raw = json.dumps({"schema": "training_step", "version": 1, **many}).encode()
    with pytest.raises(DecodeError, match=r"unknown field\(s\) 'f0', 'f1', .* and 9995 more") as err:
        decode(raw)
    assert len(str(err.value)) < 200
    raw = json.dumps({"schema": "x" * 100_000, "version": 1}).encode()
    with pytest.raises(DecodeError) as err:
        decode(raw)
    assert len(str(err.value)) < 200


# -- every field is bounded ------------------------------------------------------------------------

_INSTANTS = ("ts_ms", "source_ts_ms", "last_success_ms")


def _fields(cls: type, prefix: str = "") -> list[tuple[str, Any, dict[str, Any]]]:
    """(path, annotation, metadata) of every field of ``cls``, nested dataclasses walked."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        out.append((prefix + f.name, tp, dict(f.metadata)))
        for inner in _leaf_types(tp):
            if dataclasses.is_dataclass(inner):
                out += _fields(inner, f"{prefix}{f.name}.")
    return out


def _leaf_types(tp: Any) -> list[Any]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType, list, tuple, dict):
        args = typing.get_args(tp)
        return [leaf for a in (args[1:] if origin is dict else args) for leaf in _leaf_types(a)]
    return [tp]


def _shapes(tp: Any) -> set[str]:
    """What a field holds: int, float, str, container (list/dict), any."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return {"any"}
    if origin in (Union, types.UnionType):
        return {s for a in typing.get_args(tp) if a is not type(None) for s in _shapes(a)}
    if origin in (list, tuple, dict):
        args = typing.get_args(tp)
        inner = _shapes(args[1] if origin is dict else args[0]) | ({"str"} if origin is dict else set())
        return {"container"} | inner
    return {tp.__name__} if tp in (int, float, str) else set()


@pytest.mark.parametrize("cls", EVENTS, ids=lambda c: c.TYPE)
def test_every_field_declares_bounds_that_fit_storage(cls: type[Event]) -> None:
    missing = []
    for path, tp, meta in _fields(cls):
        shapes = _shapes(tp)
        if "int" in shapes and (meta.get("lo") is None or meta.get("hi") is None):
            missing.append(f"{path}: integers need lo and hi")
        if "int" in shapes and not -(2**63) <= meta["lo"] <= meta["hi"] <= 2**64 - 1:
            missing.append(f"{path}: integers beyond 64 bits")
        if "str" in shapes and meta.get("max_len") is None:
            missing.append(f"{path}: strings need max_len")
        if "container" in shapes and meta.get("max_items") is None:
            missing.append(f"{path}: lists and dicts need max_items")
        if path.rsplit(".", 1)[-1] in _INSTANTS and (meta.get("lo"), meta.get("hi")) != (0, MAX_TS_MS):
            missing.append(f"{path}: instants are 0..MAX_TS_MS")
    assert not missing, "\n".join(missing)
