"""CPU overload needs a sustain window before it recommends anything (issue 13 item 5): one
sample at 98% is a compile or a checkpoint, not a reason to stop a job."""

from __future__ import annotations

from trainguard.detectors import state as codec
from trainguard.detectors.node_inspector import HostThresholds, NodeInspector
from trainguard.schemas.enums import Action
from trainguard.schemas.telemetry import HostSample

GIB = 1 << 30


def _sample(ts_s: float, cpu: float, node: str = "n1") -> HostSample:
    return HostSample(
        node=node, ts_ms=int(ts_s * 1000), cpu_util_pct=cpu, load1=1.0, load5=1.0, load15=1.0,
        mem_total_bytes=64 * GIB, mem_available_bytes=32 * GIB, job="j",
    )  # fmt: skip


def _overload(inspector: NodeInspector, ts_s: float, cpu: float, node: str = "n1") -> Action | None:
    dets = [
        d
        for d in inspector.inspect(_sample(ts_s, cpu, node), int(ts_s * 1000))
        if d.category == "cpu_overload"
    ]
    return dets[0].action if dets else None


def test_one_busy_sample_is_recorded_not_acted_on() -> None:
    insp = NodeInspector(host=HostThresholds(cpu_overload_sustain_s=60))
    assert _overload(insp, 0.0, 99.0) is Action.IGNORE
    assert _overload(insp, 10.0, 40.0) is None


def test_overload_sustained_for_the_window_recommends_the_configured_action() -> None:
    insp = NodeInspector(host=HostThresholds(cpu_overload_sustain_s=60))
    actions = [_overload(insp, t, 99.5) for t in range(0, 80, 10)]
    assert actions[:6] == [Action.IGNORE] * 6  # 0..50 s of overload
    assert actions[6:] == [Action.DIAGNOSE] * 2  # 60 s and on
    # A dip below the threshold starts the window again.
    assert _overload(insp, 80.0, 50.0) is None
    assert _overload(insp, 90.0, 99.5) is Action.IGNORE


def test_nodes_are_counted_apart_and_the_window_survives_a_restore() -> None:
    insp = NodeInspector(host=HostThresholds(cpu_overload_sustain_s=30))
    _overload(insp, 0.0, 99.0, "a")
    _overload(insp, 20.0, 99.0, "b")
    moved = NodeInspector(host=HostThresholds(cpu_overload_sustain_s=30))
    moved.restore_node("a", codec.load(codec.dump(insp.node_state("a"))))
    assert "a" in moved.nodes()
    assert _overload(moved, 30.0, 99.0, "a") is Action.DIAGNOSE  # overloaded since 0 s
    assert _overload(insp, 40.0, 99.0, "b") is Action.IGNORE  # since 20 s only
    moved.drop_node("a")
    assert "a" not in moved.nodes()
