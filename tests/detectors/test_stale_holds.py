"""A recovery held for an operator is over once the job trains again after it.

Recorded on ``bench/own_job.py`` (2026-11-27): the run at ``e53769b`` had its first recovery held
for an operator (a stop race since fixed); nobody released it.  The worker reads a day of action
events back, so in the next runs of the same job name (``ddp``) the job's recovery status still
held that decision, the job counted as busy, and no stall was ever reported: a SIGSTOPped rank
left the job stalled with no decision (runs at ``4ad2192`` and ``e4920d1``).
"""

from __future__ import annotations

from trainguard.detectors.job_monitor import JobMonitor, MonitorConfig
from trainguard.detectors.stopped_job import RecoveryStatus
from trainguard.schemas.workload import TrainingStep

T0 = 1_795_900_000_000
JOB = "ddp"


def test_a_hold_the_job_trained_past_does_not_hide_its_next_stall() -> None:
    status = RecoveryStatus()
    for phase_step, phase in (("recovery", "started"), ("stop", "held")):  # an earlier run, held
        status.observe("held-earlier", phase_step, phase, T0 / 1000 - 600)
    m = JobMonitor(JOB, MonitorConfig())
    step = 100
    for ms in range(0, 20_000, 70):  # the new run trains for 20 s, then a rank is stopped
        for rank in (0, 1):
            m.on_step(TrainingStep(job=JOB, rank=rank, step=step, ts_ms=T0 + ms, step_time_s=0.07), T0 + ms)
        step += 1
    found = [d for now in range(20_000, 60_000, 500) for d in m.check(T0 + now, None, status)]
    assert any(d.kind == "hang" for d in found), [d.kind for d in found]
    assert not status.held


def test_a_hold_of_a_job_that_has_not_trained_since_stays() -> None:
    status = RecoveryStatus()
    m = JobMonitor(JOB, MonitorConfig())
    for ms in range(0, 5_000, 100):
        m.on_step(TrainingStep(job=JOB, rank=0, step=ms // 100, ts_ms=T0 + ms, step_time_s=0.1), T0 + ms)
    status.observe("held-now", "stop", "held", (T0 + 6_000) / 1000)  # the job stopped, then held
    found = [d for now in range(6_000, 120_000, 1_000) for d in m.check(T0 + now, None, status)]
    assert [d.kind for d in found if d.kind in ("hang", "stopped")] == []  # the operator's call
    assert status.held == {"held-now"}
