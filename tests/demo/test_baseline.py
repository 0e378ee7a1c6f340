"""The baseline policy (timeout, then a cold requeue from a periodic checkpoint): its stall clock,
its requeue / rollback bookkeeping with fake processes, and real tiny jobs (dp2, one rank per
machine) for periodic checkpoints, ``nan_check`` and a crash requeued after the timeout."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import pytest
from trainguard_demo import baseline, codever
from trainguard_demo.baseline import (
    BaselineConfig,
    BaselineSupervisor,
    StallClock,
    generation_done,
    generation_step,
)
from trainguard_demo.checkpoint import latest_complete
from trainguard_demo.config import LaunchSpec
from trainguard_demo.faults import inject_fault, read_faults
from trainguard_demo.launcher import JobHandle, RankProcess, launch_job
from trainguard_demo.trainer import build_parser, spec_from_args

from tests.demo.helpers import make_spec, with_ranks
from tests.net import free_port, free_port_range
from tests.waiting import wait_until

# -- job options ---------------------------------------------------------------------------------


def test_checkpoint_every_and_nan_check_round_trip() -> None:
    spec = LaunchSpec(
        job="j", cluster_dir="/c", dp=2, machines=["a", "b"], checkpoint_every=7, nan_check=True
    )
    assert LaunchSpec.from_json(spec.to_json()) == spec
    argv = spec.to_argv(1)
    assert argv[argv.index("--checkpoint-every") + 1] == "7" and "--nan-check" in argv
    for s in (spec, replace(spec, checkpoint_every=1, nan_check=False)):
        assert spec_from_args(build_parser().parse_args(s.to_argv(0))) == (s, 0)
    assert "--no-nan-check" in LaunchSpec(job="j", cluster_dir="/c").to_argv(0)
    # Older spec files (no such keys) still load, with the TrainGuard job's defaults.
    raw = json.loads(spec.to_json())
    del raw["checkpoint_every"], raw["nan_check"]
    old = LaunchSpec.from_json(json.dumps(raw))
    assert (old.checkpoint_every, old.nan_check) == (1, False)
    with pytest.raises(ValueError, match="checkpoint_every=0"):
        LaunchSpec(job="j", cluster_dir="/c", checkpoint_every=0)


def test_config_validation() -> None:
    assert BaselineConfig(port_base=1).timeout_s == 30.0
    with pytest.raises(ValueError):
        BaselineConfig(port_base=1, timeout_s=0)
    with pytest.raises(ValueError):
        BaselineConfig(port_base=1, rollback_after_failures=0)


# -- the stall logic -----------------------------------------------------------------------------


def test_stall_clock_times_out_only_without_progress() -> None:
    c = StallClock(timeout_s=4, startup_timeout_s=20)
    c.reset(100.0)
    assert not c.observe(None, 119.9) and c.observe(None, 120.0)  # never came up: startup timeout
    assert (c.best, c.since) == (None, 100.0)
    c.reset(200.0)
    assert not c.observe(None, 210.0)
    assert not c.observe(11, 215.0)  # a step past the resume step: up, the step timer starts now
    assert not c.observe(11, 218.9) and c.observe(11, 219.0)
    c.reset(300.0)
    for t, step in enumerate([0, 1, 2, 3, 4, 5]):  # steady progress never times out
        assert not c.observe(step, 300.0 + 3 * t)
    assert not c.observe(4, 318.9)  # a lower reading (a restarted rank) is not progress...
    assert c.observe(5, 319.0) and (c.best, c.since) == (5, 315.0)  # ...nor is the same step


def test_generation_step_counts_only_the_current_processes() -> None:
    pids = {0: 100, 1: 101}
    progress: dict[int, dict[str, Any]] = {0: {"pid": 100, "step": 9, "status": "running"}}
    assert generation_step(progress, pids) is None  # rank 1 not up yet
    progress[1] = {"pid": 55, "step": 30, "status": "failed"}  # the killed launch's stale record
    assert generation_step(progress, pids) is None
    progress[1] = {"pid": 101, "step": 0, "status": "starting"}
    assert generation_step(progress, pids) == 0 and not generation_done(progress, pids)
    progress = {r: {"pid": p, "step": 12, "status": "done"} for r, p in pids.items()}
    assert generation_step(progress, pids) == 12 and generation_done(progress, pids)


# -- the supervisor's bookkeeping, with fake processes --------------------------------------------


@dataclass
class FakeProc:
    rank: int
    pid: int
    machine: str = ""


class FakeCluster:
    """Stands in for launch_job / stop_job: each launch gets new pids; progress is written by hand."""

    def __init__(self) -> None:
        self.launched: list[LaunchSpec] = []
        #: the CPUs each launch was pinned to (BaselineConfig.cpus)
        self.cpus: list[frozenset[int] | None] = []
        self.stopped = 0

    def launch(self, spec: LaunchSpec, cpus: frozenset[int] | None = None) -> JobHandle:
        self.launched.append(spec)
        self.cpus.append(cpus)
        base = 1000 * len(self.launched)
        procs = [FakeProc(r, base + r) for r in range(spec.world_size)]
        return JobHandle(spec, cast(list[RankProcess], procs))

    def stop(self, handle: JobHandle, grace_s: float = 0.0) -> dict[int, int | None]:
        self.stopped += 1
        return {}

    def report(self, spec: LaunchSpec, step: int, status: str = "running") -> None:
        pid_base = 1000 * len(self.launched)
        for r in range(spec.world_size):
            path = spec.paths().progress(spec.machine_of_rank(r), spec.job, r)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"pid": pid_base + r, "step": step, "status": status}))


def test_supervisor_requeues_and_reverts_a_crash_looping_push(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = FakeCluster()
    monkeypatch.setattr(baseline, "launch_job", cluster.launch)
    monkeypatch.setattr(baseline, "stop_job", cluster.stop)
    monkeypatch.setattr(baseline, "_resume_step", lambda spec: 10)  # the latest periodic checkpoint
    spec = make_spec(tmp_path, 1, dp=2, steps=100)
    cfg = BaselineConfig(
        port_base=29000, timeout_s=5, checkpoint_every=10, startup_timeout_s=60, cpus=frozenset({1})
    )
    now = [0.0]
    sup = BaselineSupervisor(spec, cfg, clock=lambda: now[0]).start(background=False)
    first = cluster.launched[0]
    assert (first.master_port, first.checkpoint_every, first.nan_check) == (29000, 10, True)
    assert cluster.cpus == [frozenset({1})]  # the baseline's own CPUs, never the other job's
    inject_fault(tmp_path, "machine-1", "hang", persistent=True)

    def at(t: float, step: int | None = None, status: str = "running") -> None:
        now[0] = t
        if step is not None:
            cluster.report(sup.spec, step, status)
        sup.tick()

    at(5.0, 0, "starting")
    at(8.0, 14)
    at(12.9)
    assert sup.requeues == 0
    at(13.0)  # 5 s without progress after step 14: requeue
    assert sup.requeues == 1 and cluster.stopped == 1 and sup.spec.master_port == 29001
    assert read_faults(tmp_path, "machine-1") == []  # the fresh allocation has no machine fault
    at(20.0, 0, "starting")
    at(22.0, 11)
    (inc,) = sup.incidents()
    assert inc["stalled_since"] == 8.0 and inc["detected_at"] == 13.0 and inc["requeued_at"] == 13.0
    assert (inc["stalled_step"], inc["resume_step"], inc["lost_steps"]) == (14, 10, 4)
    assert inc["resumed_at"] == 22.0 and inc["rollback"] is None

    codever.set_version(tmp_path, "v2-buggy")  # a bad push: every launch now dies before step 11
    at(27.0)  # launch 2 progressed (step 11 > 10): not a crash loop
    at(30.0, 0, "starting")
    at(86.9)  # launch 3 never gets past step 10: the startup timeout (60 s from the launch) applies
    assert sup.requeues == 2
    at(87.0)
    at(90.0, 0, "starting")
    at(147.0)  # launch 4: no step past 10 either: operators revert the push
    incs = sup.incidents()
    assert [i["rollback"] for i in incs] == [None, None, None, "v2-buggy->v1"]
    assert codever.current_version(tmp_path) == "v1"
    assert [s.master_port for s in cluster.launched] == [29000, 29001, 29002, 29003, 29004]
    assert cluster.cpus == [frozenset({1})] * 5  # every requeue too
    assert all(i["resumed_at"] is None for i in incs[1:])
    assert (incs[2]["stalled_since"], incs[2]["stalled_step"], incs[2]["lost_steps"]) == (27.0, None, 0)
    at(150.0, 0, "starting")
    at(152.0, 11)
    assert sup.incidents()[-1]["resumed_at"] == 152.0
    at(160.0, 100, "done")
    assert sup.finished() and sup.finished_at == 160.0
    at(500.0)  # a finished job is never requeued
    assert sup.requeues == 4


def test_supervisor_thread_survives_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = FakeCluster()
    monkeypatch.setattr(baseline, "launch_job", cluster.launch)
    monkeypatch.setattr(baseline, "stop_job", cluster.stop)
    calls = []

    def broken(spec: LaunchSpec) -> dict[int, dict[str, Any]]:
        calls.append(1)
        raise OSError("torn progress file")

    monkeypatch.setattr(baseline, "read_progress", broken)
    sup = BaselineSupervisor(make_spec(tmp_path, 1), BaselineConfig(port_base=29000, poll_s=0.01)).start()
    try:
        wait_until(lambda: len(calls) >= 3, 10, "three polls")
        assert sup._thread is not None and sup._thread.is_alive()
    finally:
        sup.stop()
    assert cluster.stopped == 1


# -- real tiny jobs --------------------------------------------------------------------------------


def _steps_on_disk(spec: LaunchSpec) -> set[int]:
    out = set()
    for m in spec.machine_names():
        for backup in (False, True):
            out |= {int(d.name[5:]) for d in spec.paths().ckpt_root(m, spec.job, backup).glob("step-*")}
    return out


@pytest.mark.slow
def test_nan_check_turns_a_nan_into_a_crash(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, free_port(), dp=2, steps=500, nan_check=True, checkpoint_every=2)
    inject_fault(tmp_path, "machine-0", "nan", at_step=5)
    with launch_job(spec) as job:
        wait_until(lambda: job.procs[0].poll() is not None, 60, with_ranks("rank 0 to exit", job))
        assert job.procs[0].poll() == 1
        err = job.procs[0].stderr.read_text()
        assert "FloatingPointError: non-finite loss nan at step 5" in err
        assert job.progress()[0]["step"] == 4
    assert latest_complete(spec) is not None and _steps_on_disk(spec) <= {2, 4}  # periodic only


@pytest.mark.slow
def test_crash_is_requeued_after_the_timeout_from_the_last_periodic_checkpoint(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, 0, dp=2, steps=100_000)
    # Launch n rendezvouses on port_base + n: one requeue expected, room for a few.
    port_base = free_port_range(4)
    cfg = BaselineConfig(port_base=port_base, timeout_s=4.0, checkpoint_every=5, poll_s=0.5)
    inject_fault(tmp_path, "machine-0", "crash", at_step=14)
    sup = BaselineSupervisor(spec, cfg).start()
    try:
        wait_until(lambda: sup.requeues >= 1, 90, with_ranks("a requeue", sup.handle))
        wait_until(
            lambda: sup.incidents()[0]["resumed_at"] is not None, 60, with_ranks("the resume", sup.handle)
        )
        handle = sup.handle
        assert handle is not None
    finally:
        sup.stop()
    (inc, *more) = sup.incidents()
    assert not more, more
    # The timeout, not the exit, detected it: no progress for timeout_s (+ about one poll).
    assert cfg.timeout_s <= inc["detected_at"] - inc["stalled_since"] <= cfg.timeout_s + 3.0
    assert inc["stalled_since"] < inc["detected_at"] <= inc["requeued_at"] < inc["resumed_at"]
    # Work since the last periodic checkpoint (step 10) is lost: the job redoes steps 11-13.
    assert inc["resume_step"] == 10 and inc["resume_step"] % cfg.checkpoint_every == 0
    assert inc["stalled_step"] == 13 and inc["lost_steps"] == 3 and inc["master_port"] == port_base + 1
    out = handle.procs[0].stdout.read_text()
    assert "fault crash" in out and "resumed at step 10 from" in out
    assert "RuntimeError: injected crash on rank 0 at step 14" in handle.procs[0].stderr.read_text()
    assert _steps_on_disk(spec) and all(s % 5 == 0 for s in _steps_on_disk(spec))
    assert handle.progress()[0]["step"] > 10
