"""Detector state moved between two detection paths (what a worker restart or a rebalance does
through the changelog), and the state codec refusing what is not state."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.detectors import state as codec
from trainguard.detectors.job_monitor import MonitorConfig
from trainguard.detectors.keyed_state import STATEFUL, PathState
from trainguard.detectors.routing import AGGREGATION, DECIDE, INSPECTION, TRAINING, DetectionPath
from trainguard.detectors.training import StallConfig
from trainguard.schemas.control import CommandKind, Decision, Detection, Targets
from trainguard.schemas.enums import Action, ProcessRole, Severity
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.workload import StackDump, TrainingStep
from trainguard.streams.config import WorkerConfig

LINK_DOWN = "[ 5521.118340] mlx5_core 0000:5e:00.0 ib0: Link down"


def _log(node: str, ts_ms: int) -> object:
    from trainguard.schemas.workload import LogLine

    return LogLine(node=node, ts_ms=ts_ms, source="kernel", line=LINK_DOWN, job="j")


def _moved(src: PathState, stage: str, keys: list[str], cfg: WorkerConfig | None = None) -> PathState:
    """A fresh path holding ``keys``'s state of ``stage`` as ``src`` wrote it (through JSON text)."""
    dst = PathState(DetectionPath(cfg or WorkerConfig()))
    for key in keys:
        doc = src.snapshot(stage, key)
        assert isinstance(json.loads(doc), dict)
        dst.restore(stage, key, doc, now_ms=0)
    return dst


def test_a_second_flap_on_another_worker_evicts() -> None:
    a = PathState(DetectionPath(WorkerConfig()))
    nodes = ["n1", "n2"]
    for n in nodes:
        assert [d.action for d in a.path.findings(INSPECTION, _log(n, 1_000), 1_000)] == [Action.IGNORE]
    assert a.take_dirty(INSPECTION) == set(nodes)
    b = _moved(a, INSPECTION, nodes)
    for n in nodes:
        assert [d.action for d in b.path.findings(INSPECTION, _log(n, 61_000), 61_000)] == [Action.EVICT]
    # Without the state, the same flap is a first one.
    fresh = DetectionPath(WorkerConfig())
    assert [d.action for d in fresh.findings(INSPECTION, _log("n1", 61_000), 61_000)] == [Action.IGNORE]


def test_a_flap_outside_the_window_after_a_move_does_not_evict() -> None:
    a = PathState(DetectionPath(WorkerConfig()))
    a.path.findings(INSPECTION, _log("n1", 1_000), 1_000)
    b = _moved(a, INSPECTION, ["n1"])
    assert [d.action for d in b.path.findings(INSPECTION, _log("n1", 400_000), 400_000)] == [Action.IGNORE]


def test_the_dedup_window_moves_with_the_job() -> None:
    a = PathState(DetectionPath(WorkerConfig()))
    det = Detection(
        detection_id="d1", ts_ms=5, job="j", kind="xid-79", category="gpu_unavailable",
        action=Action.EVICT, node="n3", source_ts_ms=1_000,
    )  # fmt: skip
    assert a.path.decide(det, 6) is not None
    assert a.take_dirty(DECIDE) == {"j"}
    b = _moved(a, DECIDE, ["j"])
    assert b.path.decide(replace(det, detection_id="d2"), 7) is None  # the same fault: suppressed
    assert b.path.policy.suppressed == 1


def test_a_job_monitor_moves_and_its_hang_is_found_and_reported_once() -> None:
    cfg = WorkerConfig(monitor=MonitorConfig(stall=StallConfig(stall_s=30)))
    a = PathState(DetectionPath(cfg))
    for step in (1, 2):
        for r in range(4):
            a.path.findings(
                TRAINING, TrainingStep(job="j", rank=r, step=step, ts_ms=step * 1000), step * 1000
            )
    b = _moved(a, TRAINING, ["j"], cfg)
    found = b.path.check(now_ms=60_000)
    assert [(d.kind, d.action) for d in found] == [("hang", Action.AGGREGATE)]
    # The report is state too: moved again, the same stall is not reported a second time.
    c = _moved(b, TRAINING, ["j"], cfg)
    assert [d.kind for d in c.path.check(now_ms=61_000)] == []
    assert c.path.monitors["j"].config is cfg.monitor  # the worker's thresholds, not stored ones


def test_a_restored_monitor_takes_the_current_thresholds() -> None:
    a = PathState(DetectionPath(WorkerConfig(monitor=MonitorConfig(stall=StallConfig(stall_s=30)))))
    for r in range(2):
        a.path.findings(TRAINING, TrainingStep(job="j", rank=r, step=1, ts_ms=1000), 1000)
    long = WorkerConfig(monitor=MonitorConfig(stall=StallConfig(stall_s=600)))
    b = _moved(a, TRAINING, ["j"], long)
    assert b.path.check(now_ms=60_000) == []


def test_a_pending_capture_moves_and_its_stacks_are_asked_for_again() -> None:
    a = PathState(DetectionPath(WorkerConfig()))
    topo = JobTopology(job="j", tp=2, dp=1, pp=1, ranks_per_machine=1, machines=["m0", "m1"])
    dec = Decision(
        decision_id="dec1", ts_ms=1_000, job="j", action=Action.AGGREGATE, targets=Targets(),
        reason="hang", evidence={"detection": {"category": "job_hang"}},
    )  # fmt: skip
    first = a.path.start_capture(dec, topo, 1_000)
    cid = first[0].args["capture_id"]  # type: ignore[attr-defined]
    a.path.add_dump(
        StackDump(job="j", node="m0", capture_id=cid, rank=0, pid=42, role=ProcessRole.MAIN, ts_ms=1_100)
    )
    b = PathState(DetectionPath(WorkerConfig()))
    again = b.restore(AGGREGATION, "j", a.snapshot(AGGREGATION, "j"), now_ms=5_000)
    assert sorted(c.node for c in again) == ["m0", "m1"]
    assert all(c.kind is CommandKind.CAPTURE_STACKS and c.args["capture_id"] == cid for c in again)
    assert {c.command_id for c in again}.isdisjoint({c.command_id for c in first})  # type: ignore[attr-defined]
    assert not b.path.wants_capture(dec, 5_000)  # pending: no second capture of the job
    cap = b.path.captures.pending[cid]
    assert cap.dumps == [] and cap.deadline_ms > 5_000


def test_drop_forgets_every_stage() -> None:
    s = PathState(DetectionPath(WorkerConfig()))
    s.path.findings(INSPECTION, _log("n1", 1_000), 1_000)
    s.path.findings(TRAINING, TrainingStep(job="j", rank=0, step=1, ts_ms=1000), 1000)
    for stage, key in ((INSPECTION, "n1"), (TRAINING, "j")):
        assert key in s.keys(stage)
        s.drop(stage, key)
        assert key not in s.keys(stage)
    assert set(STATEFUL) == {INSPECTION, TRAINING, DECIDE, AGGREGATION}


# --- the codec refuses what is not state ---------------------------------------------------------


@pytest.mark.parametrize(
    "doc",
    [
        b"\xff\xfe",
        "[]",
        '{"v": 2, "s": null}',
        '{"v": 1, "s": {"$c": "Popen", "a": {}}}',
        '{"v": 1, "s": {"$c": "WindowCounter"}}',
        '{"v": 1, "s": {"$e": "Signals", "v": 9}}',
        '{"v": 1, "s": {"$f": "1.5"}}',
        '{"v": 1, "s": {"$zz": 1}}',
        '{"v": 1, "s": {"$ev": "{}"}}',
        '{"v": 1, "s": {"$c": "JobTopology", "a": {"job": "j", "order": "bad"}}}',
        '{"v": 1, "s": {"$q": [], "max": -1}}',
        '{"v": 1, "s": ' + "[" * 40 + "]" * 40 + "}",
        '{"v": 1, "s": {"$dc": [1, 2], "v": [3]}}',
        '{"v": 1, "s": {"$dc": [1], "v": [{"$c": "Popen"}]}}',
        '{"v": 1, "s": {"$oc": "ab", "v": "cd"}}',
    ],
)
def test_garbage_is_a_state_error(doc: str | bytes) -> None:
    with pytest.raises(codec.StateError):
        codec.load(doc)


def test_per_rank_maps_are_stored_as_columns_and_documents_of_pairs_still_load() -> None:
    steps = {r: r * 10 for r in range(5)}
    ordered = OrderedDict([("b", 1.5), ("a", None)])
    doc = codec.dump({"steps": steps, "ordered": ordered, "mixed": {1: Severity.ERROR}})
    assert '"$dc":[0,1,2,3,4],"v":[0,10,20,30,40]' in doc  # two columns, not a list per rank
    back = codec.load(doc)
    assert back["steps"] == steps and type(back["ordered"]) is OrderedDict and back["ordered"] == ordered
    assert back["mixed"] == {1: Severity.ERROR}  # not plain: pairs, as before
    # what a worker of the previous version wrote (pairs) restores the same
    old = '{"v":1,"s":{"$d":[["steps",{"$d":[[0,0],[1,10]]}],["o",{"$o":[["b",1.5]]}]]}}'
    assert codec.load(old) == {"steps": {0: 0, 1: 10}, "o": OrderedDict([("b", 1.5)])}


def test_a_restore_of_the_wrong_shape_is_a_state_error() -> None:
    s = PathState(DetectionPath(WorkerConfig()))
    with pytest.raises(codec.StateError):
        s.restore(DECIDE, "j", codec.dump({"not": "a list"}), 0)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["$c", "$d", "$dc", "$oc", "$t", "$q", "$e", "a", "v", "max", "x"]),
            inner,
            max_size=3,
        )
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_any_json_loads_or_is_a_state_error(s: object) -> None:
    try:
        codec.load(json.dumps({"v": 1, "s": s}))
    except Exception as exc:  # the point: nothing but StateError escapes
        assert isinstance(exc, codec.StateError), f"{type(exc).__name__}: {exc}"
