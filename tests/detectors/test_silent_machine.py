"""A machine that falls silent while its job stops is evicted from its liveness alone, before the
stall would ask for a stack capture that can only time out on its ranks."""

from __future__ import annotations

from trainguard.detectors.decide import DecisionPolicy
from trainguard.detectors.job_monitor import JobMonitor, MonitorConfig
from trainguard.detectors.liveness import LivenessConfig, SilentMachineDetector
from trainguard.detectors.stopped_job import RecoveryStatus
from trainguard.detectors.training import StallConfig
from trainguard.schemas.enums import Action
from trainguard.schemas.workload import RankLiveness, TrainingStep

NODES = {"n1": [0, 1], "n2": [2, 3]}


def _beat(d: SilentMachineDetector, t: float, nodes: dict[str, list[int]] = NODES) -> None:
    for node, ranks in nodes.items():
        d.liveness(node, ranks, t, 2.0)


def test_the_bound_is_intervals_with_a_floor() -> None:
    d = SilentMachineDetector(LivenessConfig(silence_intervals=3, min_silence_s=5))
    d.liveness("a", [0], 0.0, 1.0)
    d.liveness("b", [1], 0.0, 10.0)
    assert (d.bound_s("a"), d.bound_s("b")) == (5.0, 30.0)


def test_no_finding_while_the_job_progresses() -> None:
    """n1's exporter died but the job trains on: not a machine to evict."""
    d = SilentMachineDetector()
    _beat(d, 0.0)
    d.liveness("n2", [2, 3], 10.0, 2.0)
    assert d.silent(10.5) == ["n1"]
    assert d.check(10.5, last_progress=10.0) is None


def test_no_finding_when_every_machine_is_silent() -> None:
    d = SilentMachineDetector()
    _beat(d, 0.0)
    # Judged by the liveness stream's own clock: nobody spoke later than anybody else.
    assert d.silent(20.0) == [] and d.check(20.0, last_progress=0.0) is None


def test_a_node_not_running_the_job_is_not_judged() -> None:
    d = SilentMachineDetector()
    _beat(d, 0.0, {"n1": [0, 1], "n2": [2, 3], "spare": []})
    _beat(d, 10.0, {"n1": [0, 1], "n2": [2, 3]})  # the spare's exporter went away: no matter
    assert d.silent(10.5) == [] and d.check(10.5, last_progress=0.0) is None


def test_steps_count_as_hearing_from_the_node() -> None:
    d = SilentMachineDetector()
    _beat(d, 0.0)
    d.liveness("n2", [2, 3], 9.0, 2.0)
    d.step("n1", 8.0)  # its liveness lags, its ranks' steps arrive
    assert d.check(9.5, last_progress=2.0) is None
    d.step("elsewhere", 9.0)  # a node that never sent liveness is not tracked
    assert "elsewhere" not in d.heard


def test_reported_once_per_silence() -> None:
    d = SilentMachineDetector()
    _beat(d, 0.0)
    d.liveness("n2", [2, 3], 10.0, 2.0)
    f = d.check(10.5, last_progress=0.0)
    # 10 s: counted to n2's last word, the newest heard, not to the caller's clock.
    assert f is not None and f.node == "n1" and f.evidence["silent"]["n1"]["silent_for_s"] == 10.0
    assert f.evidence["machines_heard"] == 1 and f.evidence["job_stopped_for_s"] == 10.0
    assert d.check(11.0, last_progress=0.0) is None
    _beat(d, 12.0)  # n1 speaks again (a stall that passed): a later silence is new
    d.liveness("n2", [2, 3], 24.0, 2.0)
    assert d.check(24.0, last_progress=0.0) is not None


def test_disabled() -> None:
    d = SilentMachineDetector(LivenessConfig(enabled=False))
    _beat(d, 0.0)
    d.liveness("n2", [2, 3], 10.0, 2.0)
    assert d.check(10.5, last_progress=0.0) is None


def _monitor() -> JobMonitor:
    m = JobMonitor("j", MonitorConfig(stall=StallConfig(stall_s=20.0, min_stall_s=20.0)))
    for step in range(1, 6):
        for node, ranks in NODES.items():
            for r in ranks:
                m.on_step(TrainingStep(job="j", rank=r, step=step, ts_ms=step * 1000, node=node), step * 1000)
    for t in range(0, 6, 2):
        for node, ranks in NODES.items():
            m.on_liveness(RankLiveness(job="j", node=node, ts_ms=t * 1000, ranks=ranks, states=["S"] * 2))
    return m


def test_the_monitor_evicts_the_silent_machine_and_does_not_capture() -> None:
    m = _monitor()
    # n1 froze at t=5: n2 keeps speaking; the job makes no progress.
    for t in range(6, 40, 2):
        m.on_liveness(RankLiveness(job="j", node="n2", ts_ms=t * 1000, ranks=[2, 3], states=["S", "S"]))
    assert m.check(9_000) == []  # 4 s: under the 6 s bound
    (det,) = m.check(11_500)
    assert (det.kind, det.action, det.node, det.ranks) == ("machine_silent", Action.EVICT, "n1", [0, 1])
    dec = DecisionPolicy().decide(det, 11_600)
    assert dec is not None and dec.action is Action.EVICT and dec.targets.machines == ["n1"]
    # Past the 20 s stall threshold: the silent machine explains the stall, no hang capture.
    assert m.check(30_000) == []


def test_no_silence_is_judged_while_a_recovery_works() -> None:
    m = _monitor()
    for t in range(6, 40, 2):
        m.on_liveness(RankLiveness(job="j", node="n2", ts_ms=t * 1000, ranks=[2, 3], states=["S", "S"]))
    status = RecoveryStatus()
    status.observe("dec-1", "stop", "started", 10.0)
    assert m.check(11_500, recoveries=status) == []


def test_a_machine_evicted_before_the_restart_is_not_judged() -> None:
    """Its exporter went away with it; the job runs on other machines since the restart."""
    d = SilentMachineDetector()
    _beat(d, 0.0)
    # Stopped at 5, restarted by 6 on n2 and a standby; n1 was evicted and fell silent at 4.
    for t in (6.0, 8.0, 10.0, 12.0, 14.0):
        d.liveness("n2", [0, 1], t, 2.0)
        d.liveness("standby", [2, 3], t, 2.0)
    assert d.silent(14.5) == ["n1"] and d.silent(14.5, since=6.0) == []
    assert d.check(14.5, last_progress=7.0, since=6.0) is None


def test_silence_is_judged_by_the_liveness_streams_own_clock() -> None:
    """The worker's clock ran ahead (the steps topic ahead of a lagging liveness topic): a node
    heard as late as the others is not silent, whatever ``now`` says."""
    d = SilentMachineDetector()
    for t in (0.0, 2.0, 4.0):
        _beat(d, t)
    assert d.silent(now=20.0) == [] and d.check(20.0, last_progress=4.0) is None
    d.liveness("n2", [2, 3], 12.0, 2.0)  # now n2 spoke 8 s after n1's last word
    assert d.silent(now=20.0) == ["n1"]
