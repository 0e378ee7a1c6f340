"""A real 4-rank job (tp2 pp2 dp1, one rank per machine): checkpoints with backups, falling loss,
then an eviction: a warm standby takes machine-1's rank and resumes from its backup shard."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from trainguard_demo.checkpoint import backup_machine, latest_complete
from trainguard_demo.launcher import activate_standby, launch_job, launch_standby, standby_ready, stop_job

from tests.demo.helpers import losses, make_spec, with_ranks
from tests.net import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


# Two real 4-process jobs, each importing torch cold on a shared 2-core host, plus a standby (about
# 40 s when idle): its own waits allow up to 330 s, so they, not the 300 s default, say what was late.
@pytest.mark.timeout(600)
def test_run_checkpoint_and_resume_on_standby(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, free_port(), tp=2, pp=2, dp=1, steps=12)
    standby = launch_standby(tmp_path, "standby-0", slots=1)  # warms up while the job runs
    try:
        with launch_job(spec) as job:
            codes = job.wait(timeout=120)
            assert codes == dict.fromkeys(range(4), 0), [p.stderr.read_text()[-2000:] for p in job.procs]
        curve = losses(job.procs[0].stdout)
        assert sorted(curve) == list(range(1, 13))
        assert sum(curve[s] for s in (10, 11, 12)) < sum(curve[s] for s in (1, 2, 3)) - 0.3
        found = latest_complete(spec)
        assert found is not None and found[0] == 12
        peer = backup_machine(spec, "machine-1")
        assert peer is not None
        assert (spec.paths().ckpt_step(peer, "t", 12, backup=True) / "rank-00001.pt").exists()

        # Evict machine-1: its disk is gone; the standby takes rank 1 and the job runs to step 16.
        spec2 = replace(spec.replace_machine("machine-1", "standby-0"), steps=16, master_port=free_port())
        wait_until(lambda: standby_ready(tmp_path, "standby-0", 1), 60, with_ranks("standby ready", standby))
        with launch_job(spec2, machines=[m for m in spec2.machine_names() if m != "standby-0"]) as job2:
            activate_standby(spec2, "standby-0")
            codes = job2.wait(timeout=120)
            assert codes == {0: 0, 2: 0, 3: 0}, [p.stderr.read_text()[-2000:] for p in job2.procs]
            assert standby.wait(timeout=30) == {-1: 0}, standby.procs[0].stderr.read_text()[-2000:]
        resumed = standby.procs[0].stdout.read_text()
        assert "activated as rank 1" in resumed
        assert (
            f"resumed at step 12 from {tmp_path}/machines/{peer}/ckpt/t/backup/step-00000012/rank-00001.pt"
            in resumed
        )
        after = losses(standby.procs[0].stdout)
        assert sorted(after) == [13, 14, 15, 16] and after[13] < curve[1]
        assert job2.progress()[1]["step"] == 16
    finally:
        stop_job(standby, grace_s=0)
