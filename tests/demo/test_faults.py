"""Each fault hook on a real 2-rank job (pp2, one rank per machine): what a detector would see."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
from trainguard_demo import codever
from trainguard_demo.faults import inject_fault
from trainguard_demo.launcher import launch_job

from tests.demo.helpers import losses, make_spec, step_times, with_ranks
from tests.net import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def test_slow_then_nan(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, free_port(), pp=2, steps=11)
    inject_fault(tmp_path, "machine-0", "slow", at_step=5, factor=4)
    inject_fault(tmp_path, "machine-1", "nan", at_step=9)
    with launch_job(spec) as job:
        assert job.wait(timeout=90) == {0: 0, 1: 0}, [p.stderr.read_text()[-1500:] for p in job.procs]
    times = step_times(job.procs[0].stdout)
    before = (times[3] + times[4]) / 2
    after = (times[6] + times[7] + times[8]) / 3
    assert after > 2.5 * before, times
    for proc in job.procs:  # the NaN made on stage 1 reaches every rank's reported loss
        curve = losses(proc.stdout)
        assert all(math.isfinite(curve[s]) for s in range(1, 9)) and all(
            math.isnan(curve[s]) for s in (9, 10, 11)
        )


@pytest.mark.parametrize(
    ("kind", "stuck_at"),
    [("hang", 2), ("hang-checkpoint", 3), ("hang-p2p", 2)],  # hang-dataloader: test_data_path
)
def test_hang_stops_progress(tmp_path: Path, kind: str, stuck_at: int) -> None:
    spec = make_spec(tmp_path, free_port(), pp=2, steps=500)
    inject_fault(tmp_path, "machine-0", kind, at_step=3)
    with launch_job(spec) as job:
        wait_until(lambda: len(job.progress()) == 2 and min(p["step"] for p in job.progress().values()) >= 1,
                   60, with_ranks("first steps", job))  # fmt: skip
        # No progress for 3 s while every process is still alive: a hang, not an exit.
        wait_until(
            lambda: time.time() - max(p["ts"] for p in job.progress().values()) > 3,
            30,
            with_ranks("a stall", job),
        )
        assert job.exit_codes() == {0: None, 1: None}
        assert job.progress()[0]["step"] == stuck_at
        assert max(p["step"] for p in job.progress().values()) <= stuck_at + 1
        assert f"fault {kind}" in job.procs[0].stdout.read_text()


@pytest.mark.parametrize(
    ("kind", "extra", "code", "stderr_text"),
    [
        ("crash", {}, 1, "RuntimeError: injected crash on rank 0 at step 3"),
        ("crash", {"signal": "SIGSEGV"}, -11, ""),
        ("oom", {}, 1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"),
    ],
)
def test_fatal_faults(tmp_path: Path, kind: str, extra: dict[str, Any], code: int, stderr_text: str) -> None:
    spec = make_spec(tmp_path, free_port(), pp=2, steps=500)
    inject_fault(tmp_path, "machine-0", kind, at_step=3, **extra)
    with launch_job(spec) as job:
        wait_until(lambda: job.procs[0].poll() is not None, 60, with_ranks("rank 0 to exit", job))
        assert job.procs[0].poll() == code
        err = job.procs[0].stderr.read_text()
        assert stderr_text in err and ("Traceback (most recent call last)" in err) == bool(stderr_text)
        assert job.progress()[0]["step"] == 2


def test_user_error_then_rollback(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, free_port(), pp=2, steps=500, step_delay_s=0.2)
    with launch_job(spec) as job:
        wait_until(lambda: len(job.progress()) == 2 and min(p["step"] for p in job.progress().values()) >= 2,
                   60, with_ranks("first steps", job))  # fmt: skip
        inject_fault(tmp_path, "machine-0", "user-error")  # a bad code push: every rank updates in place
        assert job.wait(timeout=60) == {0: 1, 1: 1}
    # Stage 0 runs the buggy MLP first; stage 1 may die of the closed connection before its own.
    err = job.procs[0].stderr.read_text()
    assert "TypeError: gelu(): argument 'approximate' must be str, not bool" in err
    assert "trainguard_demo/versions/v2_buggy.py" in err
    stopped = max(p["step"] for p in job.progress().values())
    assert codever.rollback(tmp_path) == "v1"
    resumed = make_spec(tmp_path, free_port(), pp=2, steps=stopped + 3)
    with launch_job(resumed) as job2:
        assert job2.wait(timeout=90) == {0: 0, 1: 0}, [p.stderr.read_text()[-1500:] for p in job2.procs]
    assert f"resumed at step {stopped}" in job2.procs[0].stdout.read_text()
