"""The demo trainer's data path, on real jobs (two DP ranks, each with real DataLoader workers over
a shuffled sampler): a job stopped and resumed from its checkpoint reads, step for step, the batch
an uninterrupted job reads (SHA-256 per step, across an epoch boundary); a hung loader worker is
taken over in place by the shadow loader -- the job never stops and reads the same batches -- and
without the shadow loader the same fault stops the job."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from trainguard_demo.faults import inject_fault
from trainguard_demo.launcher import launch_job

from tests.demo.helpers import make_spec, with_ranks
from tests.net import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

STEPS = 56  # 48 full batches per epoch per DP rank (the partial 49th is dropped): into epoch 1


def _hashes(log: Path) -> dict[int, str]:
    """step -> batch hash of a rank's batch log (a resumed part appends; the last entry wins)."""
    out = {}
    for line in log.read_text().splitlines():
        step, digest = line.split()
        out[int(step)] = digest
    return out


def _run(tmp: Path, name: str, steps: int, **kw: object) -> tuple[Path, Path]:
    """Run (or resume, in the same cluster dir) a tp1 pp1 dp2 job to ``steps``; its logs' prefix."""
    cluster = tmp / name
    spec = make_spec(cluster, free_port(), dp=2, steps=steps, batch_log=str(cluster / "batches"), **kw)
    with launch_job(spec) as job:
        codes = job.wait(timeout=240)
        assert codes == {0: 0, 1: 0}, [p.stderr.read_text()[-2000:] for p in job.procs]
    return cluster / "batches", cluster


@pytest.mark.timeout(900)
def test_resumed_job_reads_the_same_batches(tmp_path: Path) -> None:
    full, _ = _run(tmp_path, "full", STEPS)
    part, cluster = _run(tmp_path, "parts", 20)
    _run(tmp_path, "parts", STEPS)  # resumes from its step-20 checkpoint, data position included
    for rank in (0, 1):
        want = _hashes(Path(f"{full}.rank-{rank}"))
        assert sorted(want) == list(range(1, STEPS + 1))
        assert _hashes(Path(f"{part}.rank-{rank}")) == want
    assert _hashes(Path(f"{full}.rank-0")) != _hashes(Path(f"{full}.rank-1"))  # each its own share
    out = (cluster / "machines" / "machine-0" / "logs" / "t" / "rank-00000.out").read_text()
    assert "resumed at step 20 from" in out and "at data epoch 0 sample 160" in out


@pytest.mark.timeout(900)
def test_hung_loader_is_taken_over_without_stopping_the_job(tmp_path: Path) -> None:
    full, _ = _run(tmp_path, "full", STEPS)
    cluster = tmp_path / "hung"
    spec = make_spec(
        cluster, free_port(), dp=2, steps=STEPS, batch_log=str(cluster / "batches"), step_delay_s=0.1
    )
    with launch_job(spec) as job:
        wait_until(lambda: min((p.get("step", 0) for p in job.progress().values()), default=0) >= 10,
                   180, with_ranks("ten steps", job))  # fmt: skip
        inject_fault(cluster, "machine-1", "hang-dataloader")
        codes = job.wait(timeout=240)
        assert codes == {0: 0, 1: 0}, [p.stderr.read_text()[-2000:] for p in job.procs]
        out = job.procs[1].stdout.read_text()
    assert "fault hang-dataloader" in out and "in its data loader" in out
    assert "trainguard shadow loader: took over from loader 1 (stalled: no batch for" in out
    for rank in (0, 1):
        assert _hashes(Path(f"{cluster / 'batches'}.rank-{rank}")) == _hashes(Path(f"{full}.rank-{rank}"))


@pytest.mark.timeout(600)
def test_without_the_shadow_loader_the_hang_stops_the_job(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, free_port(), dp=2, steps=500, shadow_loader=False, step_delay_s=0.1)
    with launch_job(spec) as job:
        wait_until(lambda: min((p.get("step", 0) for p in job.progress().values()), default=0) >= 3,
                   180, with_ranks("first steps", job))  # fmt: skip
        inject_fault(tmp_path, "machine-1", "hang-dataloader")
        wait_until(lambda: time.time() - max(p["ts"] for p in job.progress().values()) > 5, 60,
                   with_ranks("a stall", job))  # fmt: skip
        assert job.exit_codes() == {0: None, 1: None}
        assert "fault hang-dataloader" in job.procs[1].stdout.read_text()
        assert "shadow loader" not in job.procs[1].stdout.read_text()
