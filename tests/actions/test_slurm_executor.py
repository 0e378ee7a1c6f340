"""The ``slurm`` executor against a real private Slurm (munged, slurmctld, six slurmd): no mocks.

Each test runs a 4-node allocation (n1-n3 active, n4 the spare) whose "training" step is
``tests/fixtures/slurm/train_rank.py``: it appends its node and step to a file every 0.2 s and resumes
from a checkpoint, so a test can see where the step runs and that it went on from the checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import tomllib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.actions.slurm_fixture import TrainingJob, ctx, spec, start_job
from tests.actions.slurm_fixture import slurm_cluster as slurm_cluster  # the fixture
from tests.net import free_port
from tests.waiting import wait_until
from trainguard.actions.errors import PermanentError, TemporaryError
from trainguard.actions.executors.base import ExecutorEnv, create_executor, register_executor
from trainguard.actions.executors.slurm import PLUGIN, SlurmExecutor, SlurmExecutorConfig, expand_hostlist
from trainguard.actions.standby import swapped
from trainguard.infra.stack.slurm import Slurm
from trainguard.schemas.config import ConfigError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

ACTIVE, SPARE = ["n1", "n2", "n3"], ["n4"]


@pytest.fixture
def job(slurm_cluster: Slurm, tmp_path: Path) -> Iterator[TrainingJob]:
    diag = ["bash", "-c", f"test ! -e {tmp_path}/work/bad-$SLURMD_NODENAME"]
    yield from start_job(
        slurm_cluster,
        tmp_path,
        diagnostic_commands={"alignment": diag, "launch": ["true"]},
        replay_command=diag,
    )


def _commands(job: TrainingJob, word: str) -> list[list[str]]:
    return [c.argv for c in job.executor.commands if word in c.argv]


def test_plugin_is_published_and_builds_from_options(tmp_path: Path) -> None:
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert (
        pyproject["project"]["entry-points"]["trainguard.executors"]["slurm"]
        == "trainguard.actions.executors.slurm:PLUGIN"
    )
    register_executor(PLUGIN)  # the installed metadata may predate the entry point (pip install -e .)
    ex = create_executor("slurm", {"slurm_conf": "/nonexistent"}, ExecutorEnv(state_dir=tmp_path))
    assert isinstance(ex, SlurmExecutor) and ex.diagnostic_tests == ("launch",)
    options = {"job_ids": {"big": 42}, "diagnostic_commands": {"gpu": ["nvidia-smi", "-L"]}, "history": 5}
    ex = create_executor("slurm", options, ExecutorEnv(state_dir=tmp_path))
    assert isinstance(ex, SlurmExecutor) and ex.diagnostic_tests == ("gpu",) and ex.cfg.job_ids == {"big": 42}
    with pytest.raises(ConfigError):
        create_executor("slurm", {"no_such_option": 1}, ExecutorEnv(state_dir=tmp_path))


def test_hot_update_switches_the_version_once(tmp_path: Path) -> None:
    marker = tmp_path / "switched"
    cfg = SlurmExecutorConfig(
        hot_update_command=["bash", "-c", f"echo {{job}} {{version}} >> {marker}"],
        version_file=str(tmp_path / "{job}.version"),
    )
    ex = SlurmExecutor(cfg, ExecutorEnv(state_dir=tmp_path / "state"))
    s = spec("jobx", ACTIVE, SPARE)
    ex.hot_update(s, "v3", ctx("hot_update"))
    ex.hot_update(s, "v3", ctx("hot_update"))  # again (re-run step): no second switch
    assert marker.read_text() == "jobx v3\n" and (tmp_path / "jobx.version").read_text() == "v3\n"
    failing = SlurmExecutor(
        replace(cfg, hot_update_command=["false"]), ExecutorEnv(state_dir=tmp_path / "s2")
    )
    with pytest.raises(PermanentError, match="hot update of jobx to v4 failed"):
        failing.hot_update(s, "v4", ctx("hot_update"))


def test_restart_runs_on_active_nodes_stop_keeps_the_allocation(job: TrainingJob) -> None:
    ex, s = job.executor, spec(job.name, ACTIVE, SPARE)
    ex.hot_update(s, "v2", ctx("hot_update"))
    restart = ctx("restart")
    ex.restart(s, restart)
    steps = job.training_steps()
    assert len(steps) == 1 and sorted(steps[0][2]) == ACTIVE
    for node in ACTIVE:
        line = job.wait_progress(node, 0)
        assert line[3] == "1" and line[4] == "v2"  # restart count and code version reach the ranks
    assert job.progress("n4") == []  # the spare idles

    ex.restart(s, restart)  # the same step again: no second step
    # ...also by a new executor (the service crashed after the step and runs it again).
    again = SlurmExecutor(ex.cfg, ExecutorEnv(state_dir=job.state_dir))
    again.restart(s, restart)
    assert len(job.training_steps()) == 1
    assert len(_commands(job, "--kill-on-bad-exit=1")) == 1
    assert not [c for c in again.commands if c.argv[0] == "srun"]

    ex.stop(s, ctx("stop"))
    assert job.training_steps() == []
    assert job.show_job()["JobState"] == "RUNNING" and job.alloc_nodes() == ACTIVE + SPARE
    scancels = len(_commands(job, "scancel"))
    ex.stop(s, ctx("stop"))  # stopping a stopped job: no-op
    assert len(_commands(job, "scancel")) == scancels
    assert all(c.op_id for c in ex.commands)  # every command is logged with its step's op id
    assert (job.state_dir / "slurm" / "commands.jsonl").read_text().count("scancel") == scancels


@pytest.fixture
def logged_job(slurm_cluster: Slurm, tmp_path: Path) -> Iterator[TrainingJob]:
    """A job whose restarted steps write their output where the job script's `#SBATCH --output=
    %x-%j.out` style says (``srun_args``)."""
    (tmp_path / "logs").mkdir()
    yield from start_job(slurm_cluster, tmp_path, srun_args=[f"--output={tmp_path}/logs/%x-%j-%s.out"])


def test_percent_x_in_srun_args_is_the_slurm_jobs_name(logged_job: TrainingJob, tmp_path: Path) -> None:
    job, logs = logged_job, tmp_path / "logs"
    job.executor.restart(spec(job.name, ACTIVE, SPARE), ctx("restart"))
    job.wait_progress("n1", 0)
    (step,) = job.training_steps()
    assert step[1].startswith("tg-train.")  # the step keeps its own name
    wanted = f"{job.name}-{step[0].replace('.', '-')}.out"
    wait_until(
        lambda: wanted in {f.name for f in logs.iterdir()}, 10, lambda: f"{wanted} in {list(logs.iterdir())}"
    )
    assert [f.name for f in logs.iterdir()] == [wanted]  # no "(null)-..." file


def test_fault_evict_drain_and_restart_on_the_spare_from_the_checkpoint(job: TrainingJob) -> None:
    ex, s = job.executor, spec(job.name, ACTIVE, SPARE)
    ex.restart(s, ctx("restart"))
    job.wait_progress("n2", 3)
    (job.work / "fault-n2").touch()  # n2's rank fails -> the whole step ends (--kill-on-bad-exit)
    wait_until(lambda: not job.training_steps(), 20, lambda: f"the step to end ({job.steps()})")
    stopped_at = job.checkpoint()
    assert stopped_at >= 3

    decision = "d-fault-n2"
    ex.stop(s, ctx("stop", decision))  # already gone: no-op
    ex.evict(s, ["n2"], ctx("evict", decision, category="gpu_unavailable"))
    n2 = job.node("n2")
    # The reason names the decision and the fault category (issue 12), for `sinfo -R`.
    assert "DRAIN" in n2["State"] and n2["Reason"].startswith(f"trainguard {decision}: gpu_unavailable")
    updates = len(_commands(job, "State=DRAIN"))
    ex.evict(s, ["n2"], ctx("evict", decision))  # evicting an evicted node: no-op
    assert len(_commands(job, "State=DRAIN")) == updates == 1
    detail = ex.detail(ctx("evict", decision).op_id)  # for the step's action event
    assert "scontrol update NodeName=n2 State=DRAIN" in detail and "show node" not in detail

    ex.activate_standbys(s, ["n4"], ["n2"], ctx("swap_standbys", decision))
    new = swapped(s, ["n2"], ["n4"], s.ts_ms + 1)
    assert new.topology.machines == ["n1", "n4", "n3"] and new.standbys == []
    with pytest.raises(PermanentError, match="drained"):
        ex.restart(s, ctx("restart-old", decision))  # never on a drained node
    ex.restart(new, ctx("restart", decision))
    assert sorted(job.training_steps()[0][2]) == ["n1", "n3", "n4"]
    first = job.wait_progress("n4", 0)
    assert first[3] == "2"
    # Rank 0 (n1) resumes from the checkpoint, not from step 1; the others read it a little later.
    assert job.wait_generation("n1", 2)[2] == str(stopped_at + 1)
    assert stopped_at < int(first[2]) <= stopped_at + 5
    seen_n2 = len(job.progress("n2"))
    job.wait_progress("n4", int(first[2]) + 3)  # and it goes on
    assert len(job.progress("n2")) == seen_n2  # nothing runs on the drained node
    assert job.show_job()["JobState"] == "RUNNING"  # no requeue: the same allocation


def test_evict_refuses_nodes_outside_the_job(job: TrainingJob) -> None:
    ex, s = job.executor, spec(job.name, ACTIVE, SPARE)
    with pytest.raises(PermanentError, match=r"refusing to drain \['n5'\]"):
        ex.evict(s, ["n5"], ctx("evict"))
    with pytest.raises(PermanentError, match="n99 not found"):
        ex.evict(s, ["n99"], ctx("evict"))
    assert "DRAIN" not in job.node("n5")["State"]
    assert _commands(job, "State=DRAIN") == []
    with pytest.raises(PermanentError, match="not in Slurm job"):
        ex.activate_standbys(s, ["n6"], ["n1"], ctx("swap_standbys"))


def test_unknown_job_is_permanent_and_unreachable_slurm_temporary(job: TrainingJob, tmp_path: Path) -> None:
    with pytest.raises(PermanentError, match="no Slurm job named"):
        job.executor.stop(spec("no-such-job", ACTIVE, SPARE), ctx("stop"))
    # The same cluster's conf with a controller port nobody listens on.
    conf = tmp_path / "dead.conf"
    text = job.cluster.conf_file.read_text()
    port = job.cluster.cfg.ctld_port
    conf.write_text(text.replace(f"SlurmctldPort={port}", f"SlurmctldPort={free_port()}"))
    dead = SlurmExecutor(
        SlurmExecutorConfig(slurm_conf=str(conf), command_timeout_s=20),
        ExecutorEnv(state_dir=tmp_path / "dead"),
    )
    with pytest.raises(TemporaryError, match="Unable to contact slurm controller"):
        dead.stop(spec(job.name, ACTIVE, SPARE), ctx("stop"))
    # A command that does not answer in time is temporary too (and killed at its timeout).
    impatient = SlurmExecutor(replace(dead.cfg, command_timeout_s=1), ExecutorEnv(state_dir=tmp_path / "i"))
    with pytest.raises(TemporaryError, match=r"did not answer in 1\.0 s"):
        impatient.stop(spec(job.name, ACTIVE, SPARE), ctx("stop"))


def test_spare_left_in_the_allocation_is_provisioned_first(job: TrainingJob) -> None:
    ex = job.executor
    ex.stop(spec(job.name, ACTIVE, []), ctx("stop"))  # n4 is in no spec: a free spare
    step = ctx("replenish")
    assert ex.provision_standbys(job.name, 1, step) == ["n4"]
    assert ex.last_provision["path"] == "spare"
    assert ex.provision_standbys(job.name, 1, step) == ["n4"]  # same op: same answer
    # ...also from a new executor (the action service restarted mid-recovery): from its state dir.
    again = SlurmExecutor(ex.cfg, ExecutorEnv(state_dir=job.state_dir))
    assert again.provision_standbys(job.name, 1, step) == ["n4"]
    assert not again.commands  # answered without asking Slurm


def test_a_reused_job_name_is_a_new_run_whose_spares_are_its_own(job: TrainingJob) -> None:
    ex = job.executor
    ex.stop(spec(job.name, ACTIVE, SPARE), ctx("stop"))  # the first run hands out n1-n4
    first = job.job_id
    job.sh("scancel", first)
    # The same script submitted again: a new Slurm job of the same name on the same nodes.
    again = job.sh("sbatch", "--parsable", "-N", "4", "--ntasks-per-node=1", "-w", "n[1-4]", "-J", job.name,
                   "-o", str(job.work / "batch-%j.out"), "--wrap", "exec sleep infinity").strip()  # fmt: skip
    try:
        # The first run may still be completing: the running one is the job.
        job.job_id = again
        wait_until(lambda: job.show_job().get("JobState") == "RUNNING", 30, f"Slurm job {again} running")
        assert ex.slurm_job_id(job.name, ctx("lookup")) == again
        ex.stop(spec(job.name, ACTIVE, []), ctx("stop"))
        # n4 was the first run's standby; in this run it is in no spec: a free spare, not a node
        # handed out already (which sent the swap to grow or requeue the new job).
        assert ex.provision_standbys(job.name, 1, ctx("replenish")) == ["n4"]
        assert ex.last_provision["path"] == "spare"
        runs = json.loads((job.state_dir / "slurm" / f"{job.name}.json").read_text())["runs"]
        assert runs == {first: {"known": ACTIVE + SPARE}, again: {"known": ACTIVE + SPARE}}
    finally:
        job.cluster.run("scancel", again)


FAKE_SQUEUE = """#!/bin/sh
# squeue's answer to `squeue -h -n NAME -o %i|%T [-u USER]`: the rows in $SQUEUE_ROWS; logs its argv.
echo "$@" >> "$SQUEUE_LOG"
cat "$SQUEUE_ROWS"
"""


def test_the_job_of_a_reused_name_is_the_running_one_of_the_configured_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(FAKE_SQUEUE)
    (bin_dir / "squeue").chmod(0o755)
    rows, log = tmp_path / "rows", tmp_path / "argv.log"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SQUEUE_ROWS", str(rows))
    monkeypatch.setenv("SQUEUE_LOG", str(log))
    ex = SlurmExecutor(SlurmExecutorConfig(user="alice"), ExecutorEnv(state_dir=tmp_path / "state"))
    rows.write_text("41|COMPLETING\n42|RUNNING\n43|PENDING\n")
    assert ex.slurm_job_id("llm", ctx("lookup")) == "42"
    assert log.read_text() == "-h -n llm -o %i|%T -u alice\n"
    rows.write_text("42|RUNNING\n44|RUNNING\n")
    with pytest.raises(
        PermanentError, match=r"2 Slurm jobs are named 'llm' \(42 RUNNING, 44 RUNNING\), 2 of"
    ):
        ex.slurm_job_id("llm", ctx("lookup"))
    rows.write_text("43|PENDING\n")  # one job, whatever its state (a requeued one is pending)
    assert ex.slurm_job_id("llm", ctx("lookup")) == "43"


def test_exhausted_spares_requeue_with_the_bad_node_excluded(job: TrainingJob) -> None:
    ex = job.executor
    s = spec(job.name, ["n1", "n2", "n3"], ["n4"])
    ex.evict(s, ["n2"], ctx("evict", "d1"))
    s = swapped(s, ["n2"], ["n4"], s.ts_ms + 1)  # the spare is used up
    ex.restart(s, ctx("restart", "d1"))
    job.wait_progress("n4", 0)
    ex.stop(s, ctx("stop", "d2"))
    ex.evict(s, ["n3"], ctx("evict", "d2"))
    # This cluster does not permit job expansion: the standby job is refused, the job is requeued.
    # The first attempt runs out of time while the requeued job waits (the service "crashed"; 2 s
    # is too short for the release, which waits for the old run to end plus 1.1 s);
    # a new executor runs the step again and finishes that requeue instead of starting another.
    with pytest.raises(TemporaryError):
        ex.provision_standbys(job.name, 1, ctx("swap_standbys", "d2", seconds=2.0))
    ex = job.executor = SlurmExecutor(ex.cfg, ExecutorEnv(state_dir=job.state_dir))
    step = ctx("swap_standbys", "d2", seconds=60)
    got = ex.provision_standbys(job.name, 1, step)
    assert ex.last_provision["path"] == "requeue"
    assert "not supported" in " ".join(ex.last_provision["why"])
    assert len(got) == 1 and got[0] in ("n5", "n6")
    shown = job.show_job()
    assert shown["JobState"] == "RUNNING" and int(shown["Restarts"]) == 1
    nodes = job.alloc_nodes()
    assert sorted(nodes) == ["n1", "n4", "n5", "n6"]  # the healthy nodes kept, the bad ones replaced
    assert {"n2", "n3"} <= set(expand_hostlist(shown["ExcNodeList"]))
    assert ex.provision_standbys(job.name, 1, step) == got  # re-run: no second requeue
    log = (job.state_dir / "slurm" / "commands.jsonl").read_text()
    assert log.count('"requeuehold"') == 1

    s = swapped(s, ["n3"], got, s.ts_ms + 1)
    ex.activate_standbys(s, got, ["n3"], ctx("activate", "d2"))
    at = job.checkpoint()
    ex.restart(s, ctx("restart", "d2"))
    job.wait_progress(got[0], 0)
    assert job.wait_generation("n1", 2)[2] == str(at + 1)

    # The requeued job kept its size: the other new node refills the pool without a requeue...
    (other,) = {"n5", "n6"} - set(got)
    assert ex.provision_standbys(job.name, 1, ctx("replenish", "d2")) == [other]
    assert ex.last_provision["path"] == "spare"
    # ...and once the pool is dry, the running training step is never requeued for a spare.
    with pytest.raises(PermanentError, match="would kill its running training step"):
        ex.provision_standbys(job.name, 1, ctx("replenish", "d3"))
    assert (job.state_dir / "slurm" / "commands.jsonl").read_text().count('"requeuehold"') == 1
    assert job.training_steps()


def test_exhausted_spares_grow_the_allocation_where_expansion_is_permitted(job: TrainingJob) -> None:
    conf = job.cluster.conf_file
    original = conf.read_text()
    try:
        conf.write_text(original + "SchedulerParameters=permit_job_expansion\n")
        job.sh("scontrol", "reconfigure")
        wait_until(
            lambda: "permit_job_expansion" in job.sh("scontrol", "show", "config"), 20, "reconfigured ctld"
        )
        ex = job.executor
        s = spec(job.name, ACTIVE, [])
        ex.stop(s, ctx("stop"))
        ex.evict(s, ["n2"], ctx("evict"))
        got = ex.provision_standbys(job.name, 2, ctx("swap_standbys", seconds=60))
        # n4 is still a free node of the allocation; one more comes from a merged standby job.
        assert ex.last_provision["path"] == "expand"
        assert got[0] == "n4" and got[1] in ("n5", "n6")
        assert set(job.alloc_nodes()) == {"n1", "n2", "n3", "n4", got[1]}
        assert int(job.show_job()["Restarts"]) == 0  # the allocation grew in place
        s = swapped(s, ["n2"], [got[1]], s.ts_ms + 1)
        ex.restart(s, ctx("restart"))
        job.wait_progress(got[1], 0)
    finally:
        conf.write_text(original)
        job.sh("scontrol", "reconfigure")


def test_diagnostics_and_replay_run_as_steps(job: TrainingJob) -> None:
    ex, s = job.executor, spec(job.name, ACTIVE, SPARE)
    (job.work / "bad-n2").touch()
    results = ex.run_diagnostics(s, ACTIVE, ["alignment", "launch"], ctx("diagnose"))
    verdict = {(r.machine, r.test): r.passed for r in results}
    assert verdict == {
        ("n1", "alignment"): True,
        ("n2", "alignment"): False,
        ("n3", "alignment"): True,
        ("n1", "launch"): True,
        ("n2", "launch"): True,
        ("n3", "launch"): True,
    }
    failed = next(r for r in results if not r.passed)
    assert failed.detail.startswith("exit 1") and failed.duration_ms > 0
    assert _commands(job, "--job-name=tg-diag.alignment")  # one step for all nodes
    assert ex.run_replay(s, [["n1", "n3"], ["n2", "n4"]], ctx("replay_horizontal")) == [True, False]

    # A test that hangs on one node fails there, within the timeout; the others' results stand.
    hang = ["bash", "-c", 'if [ "$SLURMD_NODENAME" = n3 ]; then exec sleep 60; fi']
    cfg = replace(ex.cfg, diagnostic_commands={"hang": hang}, diagnostics_timeout_s=3)
    slow = SlurmExecutor(cfg, ExecutorEnv(state_dir=job.state_dir))
    t0 = time.monotonic()
    results = slow.run_diagnostics(s, ACTIVE, ["hang"], ctx("diagnose"))
    assert time.monotonic() - t0 < 15
    assert {r.machine: r.passed for r in results} == {"n1": True, "n2": True, "n3": False}
    assert "no result" in next(r.detail for r in results if r.machine == "n3")
    wait_until(
        lambda: not [st for st in job.steps() if st[1].startswith("tg-diag")], 15, "the diag step cancelled"
    )
    with pytest.raises(PermanentError, match="not in Slurm job"):
        ex.run_diagnostics(s, ["n5"], ["launch"], ctx("diagnose"))
    assert job.show_job()["JobState"] == "RUNNING"


def test_slurm_binaries_are_there() -> None:
    # The suite needs a Slurm client; missing binaries fail with the setup hint (not skipped).
    assert shutil.which("srun") and shutil.which("scontrol"), "run scripts/setup.sh (slurm-wlm)"


def test_usable_machines_are_the_allocations_nodes_slurm_does_not_drain(job: TrainingJob) -> None:
    """What a released swap re-plans with: the allocation as Slurm sees it now, not the spec."""
    ex, s = job.executor, spec(job.name, ACTIVE, [])  # the spec does not list the spare n4
    assert ex.usable_machines(s, [], ctx("swap_standbys")) == ["n1", "n2", "n3", "n4"]
    ex.evict(s, ["n2"], ctx("evict"))
    # n6 is no node of the job's allocation: no standby of it either
    assert ex.usable_machines(s, ["n6"], ctx("swap_standbys")) == ["n1", "n3", "n4"]
    job.cluster.run("scontrol", "update", "NodeName=n2", "State=RESUME")  # an operator repaired it
    wait_until(
        lambda: ex.usable_machines(s, [], ctx("swap_standbys")) == ["n1", "n2", "n3", "n4"],
        10,
        "n2 usable again once resumed",
    )


_FAKE_STEPS_SQUEUE = """#!/bin/sh
# squeue -h -s -j J -o ...: the steps listed in $STEP_ROWS, then (second call on) $STEP_ROWS_AFTER.
if [ -f "$STEP_ROWS.used" ]; then cat "$STEP_ROWS_AFTER"; else touch "$STEP_ROWS.used"; cat "$STEP_ROWS"; fi
"""
_FAKE_SCANCEL = """#!/bin/sh
echo "scancel: error: Kill job error on job step id $1: Invalid job id specified" >&2
exit 225
"""


@pytest.mark.parametrize("gone", [True, False])
def test_a_step_that_ends_before_scancel_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gone: bool
) -> None:
    """The race of bench/own_job.py: srun's --kill-on-bad-exit ended the training step right after
    a rank died, between the executor's listing and its scancel, which then failed ("Invalid job id
    specified"); the recovery was held for an operator and the job left dead.  A step that is gone
    is stopped; one still listed makes the failure a failure."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("squeue", _FAKE_STEPS_SQUEUE), ("scancel", _FAKE_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    rows, after = tmp_path / "rows", tmp_path / "after"
    rows.write_text("12.0|tg-train|n[1-2]\n12.1|tg-exporter|n[1-5]\n")
    after.write_text("12.1|tg-exporter|n[1-5]\n" if gone else "12.0|tg-train|n[1-2]\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("STEP_ROWS", str(rows))
    monkeypatch.setenv("STEP_ROWS_AFTER", str(after))
    ex = SlurmExecutor(
        SlurmExecutorConfig(keep_steps=["tg-exporter"], stop_timeout_s=1.0),
        ExecutorEnv(state_dir=tmp_path / "state"),
    )
    if gone:
        ex._cancel_training("12", ctx("stop"))
    else:
        with pytest.raises((PermanentError, TemporaryError)):
            ex._cancel_training("12", ctx("stop"))
