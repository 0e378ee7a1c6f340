"""An exit that arrives after the restarted rank's first steps is an earlier process's.

Recorded on ``bench/own_job.py`` (run ``20261127-210645``, job ``ddp``, 2026-11-27): the second
SIGKILL's exits (rank 0 on n1, SIGKILL; rank 1 on n2, SIGTERM from srun; and the exporter's own
"ended, status unseen" for both, at 21:11:10.1-21:11:11.1) reached the worker after the restarted
ranks' first steps (21:11:17.4), on their own topic.  Each marked its rank dead; the stall
detector reports no hang while a rank is dead, so the rank SIGSTOPped 15 s later left the job
stalled with no decision at all.  The times below are those of the run, in ms from 21:11:00.
"""

from __future__ import annotations

from trainguard.detectors.job_monitor import JobMonitor, MonitorConfig
from trainguard.schemas.workload import ProcessExit, TrainingStep

T0 = 1_795_900_260_000  # 21:11:00 UTC, the run's clock
JOB = "ddp"


def _step(rank: int, step: int, ms: int) -> TrainingStep:
    node = ("n1", "n2")[rank]
    return TrainingStep(job=JOB, rank=rank, step=step, ts_ms=T0 + ms, node=node, loss=0.5, step_time_s=0.07)


def _exits() -> list[ProcessExit]:
    return [
        ProcessExit(node="n1", ts_ms=T0 + 10_106, pid=27044, job=JOB, rank=0, exit_code=137, signal=9),
        ProcessExit(node="n2", ts_ms=T0 + 10_233, pid=27049, job=JOB, rank=1, exit_code=143, signal=15),
        ProcessExit(node="n2", ts_ms=T0 + 11_106, pid=27049, job=JOB, rank=1, reason="ended, status unseen"),
        ProcessExit(node="n1", ts_ms=T0 + 11_135, pid=27044, job=JOB, rank=0, reason="ended, status unseen"),
    ]


def test_exits_older_than_the_ranks_newest_step_do_not_mark_it_dead() -> None:
    m = JobMonitor(JOB, MonitorConfig())
    step = 3489
    for ms in range(17_400, 33_000, 70):  # both ranks step after the restart, to 21:11:33
        for rank in (0, 1):
            m.on_step(_step(rank, step, ms), T0 + ms)
        step += 1
    for e in _exits():  # late: after the new steps
        m.on_exit(e, T0 + 33_500)
    assert m.alive == {0: True, 1: True}
    # Rank 1 stopped at 21:11:33: the stall is reported (a hang to capture), not left alone.
    found = [d for now in range(34_000, 60_000, 500) for d in m.check(T0 + now)]
    assert any(d.kind in ("hang", "hang_suspect") for d in found), [d.kind for d in found]


def test_an_exit_newer_than_the_ranks_steps_still_marks_it_dead() -> None:
    m = JobMonitor(JOB, MonitorConfig())
    for i, ms in enumerate(range(0, 5_000, 100)):
        for rank in (0, 1):
            m.on_step(_step(rank, 100 + i, ms), T0 + ms)
    m.on_exit(
        ProcessExit(node="n2", ts_ms=T0 + 5_050, pid=9, job=JOB, rank=1, exit_code=137, signal=9), T0 + 5_100
    )
    assert m.alive[1] is False
