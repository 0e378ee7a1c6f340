"""The stall threshold follows the job's step time, a stopped job is not stalled, and a capture is
judged as soon as its last answer arrives (issues 13 item 3 and 14: hangs found in seconds).

The replay tests run the recorded demo incidents (``tests/fixtures/incidents``, real runs) once
with the fixed 6 s threshold they were recorded with and once with the threshold derived from
their own step times.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainguard.detectors import state as codec
from trainguard.detectors.capture import AggregationConfig, Capture, Captures
from trainguard.detectors.job_monitor import JobMonitor, MonitorConfig
from trainguard.detectors.replay import ReplayConfig, decode_records, replay_events
from trainguard.detectors.routing import DetectionPath
from trainguard.detectors.stopped_job import RecoveryStatus
from trainguard.detectors.training import StallConfig, StepStallDetector
from trainguard.infra.replay import read_recording
from trainguard.schemas.config import ConfigError, load_config
from trainguard.schemas.control import Decision, stable_id
from trainguard.schemas.enums import Action, ProcessRole
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.workload import FlightRecorderDump, ProcessInfo, StackDump, TrainingStep

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "incidents"
ROWS: list[dict[str, Any]] = yaml.safe_load((FIXTURES / "expected.yaml").read_text())
HANGS = ("hang", "hang-dataloader", "hang-checkpoint")


def _replay_hangs(row: dict[str, Any], stall: dict[str, Any]) -> list[tuple[float, float]]:
    """(seconds after the injection, threshold) of every hang detection replaying ``row``."""
    section = yaml.safe_load((FIXTURES / (row.get("worker") or "worker.yaml")).read_text())
    section = copy.deepcopy(section)
    section["monitor"]["stall"].update(stall)
    section["check_interval_s"] = 0.5
    events, _ = decode_records(read_recording(FIXTURES / row["recording"]))
    prior, _ = decode_records(read_recording(FIXTURES / row["prior_decisions"]))
    result = replay_events(
        events,
        ReplayConfig.from_worker_section(section),
        prior=[d for _, d in prior if isinstance(d, Decision)],
    )
    return [
        ((d.ts_ms - row["injected_at_ms"]) / 1000, float(d.evidence["threshold_s"]))
        for d in result.detections
        if d.kind == "hang"
    ]


FIXED = {"stall_s": 6.0, "step_time_factor": 0.0}
DERIVED = {"stall_s": 6.0, "step_time_factor": 3.0, "min_stall_s": 2.0}


@pytest.mark.parametrize("fault", HANGS)
def test_a_recorded_hang_is_found_seconds_earlier_with_the_derived_threshold(fault: str) -> None:
    (row,) = [r for r in ROWS if r["fault"] == fault]
    (fixed,) = _replay_hangs(row, FIXED)
    (derived,) = _replay_hangs(row, DERIVED)
    assert fixed[1] == 6.0
    # The demo's steps take 0.3-0.8 s (p99 under 1 s): 3 x p99 is 2-3 s, inside [2 s, 6 s].
    assert 2.0 <= derived[1] < 3.5
    assert derived[0] <= fixed[0] - 2.5, (fixed, derived)
    assert 0 < derived[0] < 5.0


@pytest.mark.parametrize("fault", [r["fault"] for r in ROWS if r["fault"] not in HANGS])
def test_no_recorded_incident_without_a_hang_is_taken_for_one(fault: str) -> None:
    """Crashes, Xids, NaN restarts, NIC faults, a slow rank: their ranks stop or die or slow, and
    none of it (nor the healthy steps before) may look like a hang at the lower threshold."""
    (row,) = [r for r in ROWS if r["fault"] == fault]
    assert _replay_hangs(row, DERIVED) == []


def _steps(
    d: StepStallDetector, n: int, dt: float, ranks: int = 2, t0: float = 0.0, timed: bool = True
) -> float:
    t = t0
    for step in range(1, n + 1):
        t += dt
        for r in range(ranks):
            d.update(r, step, t, dt if timed else None)
    return t


def test_the_threshold_is_a_quantile_of_step_times_within_floor_and_cap() -> None:
    cfg = StallConfig(stall_s=100.0, step_time_factor=4.0, min_stall_s=3.0, min_step_samples=10)
    d = StepStallDetector(cfg)
    _steps(d, 4, 2.0)  # 8 samples: too few, the cap holds
    assert d.threshold_s() == 100.0
    _steps(d, 20, 2.0, t0=10.0)
    assert d.threshold_s() == 8.0  # 4 x 2 s
    d2 = StepStallDetector(cfg)
    _steps(d2, 20, 0.1)
    assert d2.threshold_s() == 3.0  # 4 x 0.1 s is under the floor
    d3 = StepStallDetector(cfg)
    _steps(d3, 20, 60.0)
    assert d3.threshold_s() == 100.0  # 4 x 60 s is over the cap
    off = StepStallDetector(StallConfig(stall_s=100.0, step_time_factor=0.0))
    _steps(off, 50, 0.5)
    assert off.threshold_s() == 100.0


def test_without_reported_step_times_the_gaps_between_steps_count_but_not_an_outage() -> None:
    cfg = StallConfig(stall_s=30.0, step_time_factor=3.0, min_stall_s=1.0, min_step_samples=10)
    d = StepStallDetector(cfg)
    t = _steps(d, 20, 0.5, timed=False)
    assert d.threshold_s() == pytest.approx(1.5)
    # A 40 s stop and a restart from a checkpoint 3 steps back: neither gap is a step time.
    for r in range(2):
        d.update(r, 21, t + 40.0)
        d.update(r, 18, t + 41.0)
    assert d.threshold_s() == pytest.approx(1.5)


def test_a_slow_tail_raises_the_threshold() -> None:
    cfg = StallConfig(stall_s=600.0, step_time_factor=5.0, min_stall_s=1.0, step_time_window=100)
    d = StepStallDetector(cfg)
    t = _steps(d, 45, 1.0)
    for r in range(2):
        d.update(r, 46, t + 4.0, 4.0)  # 2 in 100 samples at 4 s: the p99 is 4 s
    assert d.threshold_s() == 20.0


def test_a_restarts_first_steps_do_not_raise_the_threshold() -> None:
    """After a stop, each rank's first step (a process start, a checkpoint load: 1-2 s in the
    demo against 0.3-0.8 s steps) is reported with its own time; it is not a sample of the job's
    step time, or every restart would lift the p99 and delay the next hang's detection."""
    cfg = StallConfig(stall_s=6.0, step_time_factor=3.0, min_stall_s=1.0, step_time_window=100)
    d = StepStallDetector(cfg)
    t = _steps(d, 45, 0.5, ranks=8)
    assert d.threshold_s() == pytest.approx(1.5)
    for r in range(8):  # stopped for 5 s, then resumed at the next step: 1.8 s first steps
        d.update(r, 46, t + 5.0 + 1.8, 1.8)
    assert d.threshold_s() == pytest.approx(1.5)
    for r in range(8):  # ... and the steps after them count again
        d.update(r, 47, t + 7.3, 0.5)
    assert d.threshold_s() == pytest.approx(1.5) and len(d._times or ()) == 100
    # A long step that follows its predecessor directly is a step time like any other.
    for r in range(8):
        d.update(r, 48, t + 7.3 + 1.8, 1.8)
    assert d.threshold_s() == pytest.approx(5.4)


def test_stall_settings_are_checked() -> None:
    with pytest.raises(ConfigError):
        load_config(StallConfig, {"step_time_quantile": 1.5})
    with pytest.raises(ConfigError):
        load_config(StallConfig, {"stall_factor": 3})  # unknown key
    assert load_config(StallConfig, {"step_time_factor": 0}).step_time_factor == 0


def _monitor() -> JobMonitor:
    cfg = MonitorConfig(stall=StallConfig(stall_s=60.0, step_time_factor=3.0, min_stall_s=2.0))
    m = JobMonitor("j", cfg)
    for step in range(1, 21):
        for r in range(2):
            m.on_step(TrainingStep(job="j", rank=r, step=step, ts_ms=step * 500, step_time_s=0.5), step * 500)
    return m  # last step at 10 s; threshold 2 s


def _hangs(m: JobMonitor, now_s: float, status: RecoveryStatus | None = None) -> list[Any]:
    return [d for d in m.check(int(now_s * 1000), recoveries=status) if d.kind == "hang"]


def test_a_job_a_recovery_is_working_on_is_not_hung() -> None:
    m = _monitor()
    status = RecoveryStatus()
    status.observe("d1", "recovery", "started", ts=10.5)
    status.observe("d1", "stop", "started", ts=10.6)
    assert _hangs(m, 13.0, status) == []  # stopped on purpose
    status.observe("d1", "restart", "succeeded", ts=14.0)
    status.observe("d1", "recovery", "succeeded", ts=15.0)
    assert _hangs(m, 16.5, status) == []  # counted from the recovery's end, not from step 20
    (hang,) = _hangs(m, 17.1, status)
    assert hang.evidence["threshold_s"] == 2.0


def test_recoveries_that_stop_nothing_do_not_postpone_a_hang() -> None:
    """A NIC tolerated every second ends a no-op recovery every second: the stall still counts
    from the last step."""
    m = _monitor()
    status = RecoveryStatus()
    for i in range(3):
        status.observe(f"flap{i}", "recovery", "started", ts=10.2 + i)
        status.observe(f"flap{i}", "recovery", "succeeded", ts=10.3 + i)
    (hang,) = _hangs(m, 12.6, status)
    assert hang.evidence["stalled_for_s"] == pytest.approx(2.6)


def test_the_step_time_window_is_not_kept_in_the_worker_state_and_refills() -> None:
    """The window is rebuilt from the next steps after a move (writing 512 floats per job with
    every flush cost the worker a fifth of its CPU); until then the cap holds."""
    d = StepStallDetector(StallConfig(stall_s=60.0))
    _steps(d, 30, 1.0)
    assert d.threshold_s() == 10.0
    doc = codec.dump(d)
    assert "_times" not in doc
    restored = codec.load(doc)
    assert isinstance(restored, StepStallDetector)
    restored.config = StallConfig(stall_s=60.0, min_step_samples=20)
    assert restored.threshold_s() == 60.0
    # Steps 1..11 again after step 30: the first is a rewind (a first step, not a sample), then
    # 2 ranks x 10 steps: 20 samples.
    _steps(restored, 11, 1.0, t0=40.0)
    assert restored.threshold_s() == 10.0  # 5 x 1 s, floored at 10 s
    status = codec.load(codec.dump(RecoveryStatus()).replace("last_stop_end", "x"))
    assert isinstance(status, RecoveryStatus) and status.last_stop_end is None


def test_lists_of_plain_values_encode_as_they_are() -> None:
    from collections import deque

    doc = codec.dump({"a": [1, 2.5, "x"], "q": deque([0.1, 0.2], maxlen=4), "n": [(1, 2)]})
    assert '["a",[1,2.5,"x"]]' in doc and '"$q":[0.1,0.2]' in doc
    back = codec.load(doc)
    assert back["a"] == [1, 2.5, "x"] and back["q"] == deque([0.1, 0.2], maxlen=4) and back["n"] == [(1, 2)]


TOPO = JobTopology(job="j", machines=("m0", "m1"), tp=1, pp=1, dp=2, ranks_per_machine=1)


def _dump(cid: str, rank: int, pid: int, role: ProcessRole, tree: list[int]) -> StackDump:
    return StackDump(
        job="j", node=f"m{rank}", rank=rank, pid=pid, capture_id=cid, ts_ms=1_100, role=role,
        process_tree=[ProcessInfo(pid=p) for p in tree],
    )  # fmt: skip


def test_a_capture_is_complete_when_every_process_of_every_rank_answered() -> None:
    caps = Captures()
    dec = Decision(
        decision_id="d",
        ts_ms=1_000,
        job="j",
        action=Action.AGGREGATE,
        evidence={"detection": {"category": "job_hang"}},
    )
    cap = caps.start(dec, TOPO, 1_000)
    cid = stable_id("capture", "d")
    assert caps.pending[cid] is cap
    assert caps.add(_dump(cid, 0, 10, ProcessRole.MAIN, [10]))
    assert not caps.complete(cid)  # rank 1 has not answered
    # Rank 1's main process arrives before its DataLoader worker: the worker's stack decides a
    # dataloader hang, so the capture is not complete without it.
    assert caps.add(_dump(cid, 1, 20, ProcessRole.MAIN, [20, 21]))
    assert not caps.complete(cid)
    assert caps.add(_dump(cid, 1, 21, ProcessRole.DATALOADER, [20, 21]))
    # A hang's capture asked every rank for its Flight Recorder too: one answer per rank, a dump
    # or why there is none.
    assert cap.flight_recorder and all(c.args["flight_recorder"] for c in caps.commands(cap))
    assert not caps.complete(cid)
    assert caps.add_fr(FlightRecorderDump(job="j", node="n1", rank=0, ts_ms=1_100, capture_id=cid, error="x"))
    assert not caps.complete(cid)
    assert caps.add_fr(FlightRecorderDump(job="j", node="n1", rank=1, ts_ms=1_100, capture_id=cid, error="x"))
    assert caps.complete(cid)
    assert [c.capture_id for c in caps.due(1_200)] == [cid]
    assert not caps.complete(cid)  # closed: nothing pending


def test_without_the_flight_recorder_the_stacks_complete_a_capture() -> None:
    caps = Captures(AggregationConfig(flight_recorder=False))
    dec = Decision(
        decision_id="d", ts_ms=1_000, job="j", action=Action.AGGREGATE,
        evidence={"detection": {"category": "job_hang"}},
    )  # fmt: skip
    cap = caps.start(dec, TOPO, 1_000)
    assert isinstance(cap, Capture) and not cap.flight_recorder
    assert all("flight_recorder" not in c.args for c in caps.commands(cap))
    cid = cap.capture_id
    caps.add(_dump(cid, 0, 10, ProcessRole.MAIN, [10]))
    caps.add(_dump(cid, 1, 20, ProcessRole.MAIN, [20]))
    assert caps.complete(cid)


def _hang_capture(path: DetectionPath, stalled_since_ms: int) -> Capture:
    dec = Decision(
        decision_id="d-hang", ts_ms=stalled_since_ms + 2_500, job="j", action=Action.AGGREGATE,
        evidence={"detection": {"kind": "hang", "category": "job_hang", "source_ts_ms": stalled_since_ms}},
    )  # fmt: skip
    path.start_capture(dec, TOPO, stalled_since_ms + 2_600)
    (cap,) = path.captures.pending.values()
    assert cap.stalled_since_ms == stalled_since_ms
    return cap


def test_a_hang_the_job_stepped_past_evicts_nobody() -> None:
    """A demo run's worker saw no step for 2.3 s (they reached it 2 s late), suspected a hang, and
    the capture of the healthy, training job named a suspect: two healthy machines evicted.  A
    capture whose job has stepped since the stall was reported is now healthy, unanalysed."""
    path = DetectionPath(ReplayConfig())
    for step in range(1, 11):
        for rank in range(2):
            path.findings(
                "training", TrainingStep(job="j", rank=rank, step=step, ts_ms=step * 400), step * 400
            )
    cap = _hang_capture(path, stalled_since_ms=4_000)  # requested at 6.6 s
    assert path.moot_capture(cap, 7_000) is None  # no step since: a real hang, analyse it
    # A real hang's last step, taken before it hung, delivered late: still a hang.  (Counting it
    # as progress left a real hang unevicted for a minute in a demo run.)
    path.findings("training", TrainingStep(job="j", rank=1, step=11, ts_ms=4_400), 7_100)
    assert path.moot_capture(cap, 7_150) is None
    # A step taken after the capture was requested: the job trains, it was not hung.
    path.findings("training", TrainingStep(job="j", rank=0, step=12, ts_ms=6_800), 7_100)
    det = path.moot_capture(cap, 7_200)
    assert det is not None and det.action is Action.NONE and det.category == "healthy"
    assert det.evidence["verdict"] == "healthy" and det.evidence["last_step_ms"] == 6_800
    # ... and the false alarm does not hold back the capture of a real hang that follows.
    path.captures.pending.clear()
    nxt = Decision(decision_id="d-hang-2", ts_ms=9_000, job="j", action=Action.AGGREGATE)
    assert path.wants_capture(nxt, 9_000)


def test_a_capture_that_was_analysed_keeps_its_cooldown() -> None:
    path = DetectionPath(ReplayConfig())
    path.findings("training", TrainingStep(job="j", rank=0, step=1, ts_ms=1_000), 1_000)
    cap = _hang_capture(path, stalled_since_ms=1_000)
    assert path.moot_capture(cap, 4_000) is None  # no step since: analysed, a real hang
    path.captures.pending.clear()
    nxt = Decision(decision_id="d-hang-2", ts_ms=9_000, job="j", action=Action.AGGREGATE)
    assert not path.wants_capture(nxt, 9_000)  # within the cooldown of the real one


def test_a_capture_for_a_slow_rank_is_always_analysed() -> None:
    path = DetectionPath(ReplayConfig())
    path.findings("training", TrainingStep(job="j", rank=0, step=1, ts_ms=1_000), 1_000)
    dec = Decision(
        decision_id="d-slow", ts_ms=2_000, job="j", action=Action.AGGREGATE,
        evidence={"detection": {"kind": "mfu_decline", "category": "mfu_decline", "source_ts_ms": 500}},
    )  # fmt: skip
    path.start_capture(dec, TOPO, 2_000)
    (cap,) = path.captures.pending.values()
    assert cap.stalled_since_ms is None and path.moot_capture(cap, 3_000) is None
