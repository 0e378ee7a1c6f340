"""Recoveries that never dead-end on a documented minimal configuration (no broker: the runner
alone, on the dry-run executor, and the ``trainguard actions`` commands on its state store).

* a rung the site cannot run (no replay command, no code history) is skipped, recorded and
  logged, and the ladder restarts the job instead of holding it;
* a swap that found no spare machine is held; ``add-standby`` / ``return-node`` put machines into
  the job's pool, and the released swap asks the executor what is usable now.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from tests.actions.conftest import job_spec, make_decision
from tests.actions.runner_harness import Published
from trainguard.actions.config import ActionsConfig, StepPolicy
from trainguard.actions.executors.base import ExecutorEnv
from trainguard.actions.executors.dry_run import DryRunConfig, DryRunExecutor
from trainguard.actions.executors.kubernetes import KubernetesExecutor, KubernetesExecutorConfig
from trainguard.actions.executors.slurm import SlurmExecutor, SlurmExecutorConfig
from trainguard.actions.progress import ProgressStore
from trainguard.actions.recovery import RecoveryRunner
from trainguard.actions.state import RecoveryState
from trainguard.cli import main
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import JobSpec
from trainguard.schemas.enums import Action


class InstantStop(threading.Event):
    """A stop event whose waits return at once (retries without the backoff's sleeps)."""

    def wait(self, timeout: float | None = None) -> bool:
        return False


def _runner(
    tmp_path: Path, dry: DryRunConfig, spec: JobSpec
) -> tuple[RecoveryRunner, DryRunExecutor, Published]:
    # The swap gives up at once when it finds no spare (the default retries for three minutes).
    cfg = ActionsConfig(spec_wait_s=0, steps={"swap_standbys": StepPolicy(retries=0)})
    executor = DryRunExecutor(dry, ExecutorEnv(state_dir=tmp_path / "executor"))
    store, events = ProgressStore(tmp_path / "progress.sqlite"), Published()
    store.save_spec(spec)
    return RecoveryRunner(cfg, store, executor, events, store.spec, stop=InstantStop()), executor, events


def _run(runner: RecoveryRunner, job: str, action: Action, machines: list[str] | None = None) -> Any:
    d = make_decision(job, action, machines)
    assert runner.store.accept(d, now_ms() + 5)  # after the job's previous recovery ended
    return runner.run(d.decision_id)


def _calls(executor: DryRunExecutor, call: str) -> list[dict[str, Any]]:
    return [r for r in executor.records() if r["call"] == call]


def test_a_crash_whose_ladder_reaches_replay_without_a_replay_command_restarts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The user trial: the documented slurm config has no replay_command and no code history."""
    job = "job-noreplay"
    runner, executor, events = _runner(tmp_path, DryRunConfig(unconfigured=["run_replay"]), job_spec(job))
    first = _run(runner, job, Action.DIAGNOSE)
    assert first.state is RecoveryState.SUCCEEDED and first.path == "reattempt"
    caplog.set_level(logging.WARNING, "trainguard.actions.recovery")
    again = _run(runner, job, Action.DIAGNOSE)  # it crashes again: rollback, then replay
    assert again.state is RecoveryState.SUCCEEDED, again.held_reason
    assert again.path == "replay" and not _calls(executor, "run_replay")
    assert [c["decision_id"] for c in _calls(executor, "restart")] == [first.decision_id, again.decision_id]
    steps = {s["key"]: s for s in runner.store.steps(again.decision_id)}
    assert {k: s["status"] for k, s in steps.items()} == {
        "stop": "done",
        "diagnose": "done",
        "rollback": "skipped",
        "replay": "skipped",
        "restart": "done",
    }
    assert '"the executor cannot run_replay: dry run' in steps["replay"]["result"]
    assert "skipped replay (the executor cannot run_replay" in again.detail
    end = [e for e in events.actions if e.decision_id == again.decision_id and e.step == "recovery"][-1]
    assert end.phase.value == "succeeded" and "skipped rollback (no earlier code version" in end.detail
    skips = [r.getMessage() for r in caplog.records if "going on to the next rung" in r.getMessage()]
    assert len(skips) == 2 and "replay skipped" in skips[1]  # once each, though re-planned per step


def _held_for_want_of_a_spare(
    tmp_path: Path, dry: DryRunConfig
) -> tuple[RecoveryRunner, DryRunExecutor, Any]:
    job = "job-nospare"
    runner, executor, _ = _runner(tmp_path, dry, job_spec(job, n=3, standbys=0))
    rec = _run(runner, job, Action.EVICT, [f"{job}-n1"])
    assert rec.state is RecoveryState.HELD and rec.held_step == "swap_standbys"
    assert "no spare machines for job job-nospare" in rec.held_reason
    assert "trainguard actions return-node --job job-nospare NODE" in rec.held_reason
    return runner, executor, rec


def _cli(tmp_path: Path, *args: str) -> Result:
    env = {"TRAINGUARD__ACTIONS__STATE_DIR": str(tmp_path)}
    return CliRunner().invoke(main, ["actions", *args], env=env)


def test_a_returned_node_lets_a_held_no_spares_recovery_proceed_after_release(tmp_path: Path) -> None:
    # The only machine outside the job is the one being evicted: nothing to provision.
    dry = DryRunConfig(free_nodes=["job-nospare-n1"])
    runner, executor, rec = _held_for_want_of_a_spare(tmp_path, dry)
    # Resumed in the cluster but not given back: TrainGuard still keeps it out.
    executor.resume(["job-nospare-n1"])
    assert _cli(tmp_path, "release", rec.decision_id).exit_code == 0
    again = runner.run(rec.decision_id)
    assert again.state is RecoveryState.HELD
    assert "evicted machines stay out until returned: ['job-nospare-n1']" in again.held_reason

    out = _cli(tmp_path, "return-node", "--job", "job-nospare", "job-nospare-n1")
    assert out.exit_code == 0, out.output
    assert out.stdout == "job-nospare-n1: back in the standby pool of job job-nospare\n"
    assert f"trainguard actions release {rec.decision_id}" in out.stderr
    assert _cli(tmp_path, "release", rec.decision_id).exit_code == 0
    done = runner.run(rec.decision_id)
    assert done.state is RecoveryState.SUCCEEDED, done.held_reason
    swap = runner.store.step_results(rec.decision_id)["swap_standbys"]
    assert swap["activated"] == ["job-nospare-n1"] and swap["replaced"] == ["job-nospare-n1"]
    assert swap["pool"]["from"] == "executor" and swap["pool"]["offered"] == ["job-nospare-n1"]
    assert _calls(executor, "restart")[-1]["args"]["machines"] == [f"job-nospare-n{i}" for i in range(3)]
    # Evicted again later, it is excluded again.
    runner.store.step_done(
        "later", "evict", {}, now_ms() + 60_000, job="job-nospare", evicted=["job-nospare-n1"]
    )
    assert runner.store.evicted_machines("job-nospare") == {"job-nospare-n1"}
    assert runner.store.pool_offers("job-nospare") == []


def test_an_added_standby_lets_a_held_no_spares_recovery_proceed_after_release(tmp_path: Path) -> None:
    runner, executor, rec = _held_for_want_of_a_spare(tmp_path, DryRunConfig(free_nodes=["job-nospare-n1"]))
    out = _cli(tmp_path, "add-standby", "--job", "job-nospare", "fresh-7")
    assert out.exit_code == 0, out.output
    assert out.stdout == "fresh-7: in the standby pool of job job-nospare\n"
    assert _cli(tmp_path, "release", rec.decision_id).exit_code == 0
    done = runner.run(rec.decision_id)
    assert done.state is RecoveryState.SUCCEEDED, done.held_reason
    spec = runner.store.spec("job-nospare")
    assert spec is not None and spec.topology.machines == ["job-nospare-n0", "fresh-7", "job-nospare-n2"]
    assert [c["args"] for c in _calls(executor, "activate_standbys")] == [
        {"standbys": ["fresh-7"], "replaces": ["job-nospare-n1"]}
    ]


def test_a_released_swap_takes_the_nodes_the_executor_reports_usable_now(tmp_path: Path) -> None:
    """The spec's pool is stale: the allocation has a spare the spec never listed."""
    job = "job-nospare"
    allocation = [f"{job}-n0", f"{job}-n1", f"{job}-n2", f"{job}-spare"]
    dry = DryRunConfig(free_nodes=[f"{job}-n1"], allocation=allocation)
    runner, executor, rec = _held_for_want_of_a_spare(tmp_path, dry)
    assert not _calls(executor, "usable_machines")  # only a released swap asks
    runner.store.release(rec.decision_id)
    done = runner.run(rec.decision_id)
    assert done.state is RecoveryState.SUCCEEDED, done.held_reason
    swap = runner.store.step_results(rec.decision_id)["swap_standbys"]
    assert swap["activated"] == [f"{job}-spare"]
    # n1 is drained (evicted): not usable, and excluded anyway
    assert swap["pool"]["usable"] == [f"{job}-n0", f"{job}-n2", f"{job}-spare"]
    assert len(_calls(executor, "usable_machines")) == 1


def test_add_standby_and_return_node_help_and_errors(tmp_path: Path) -> None:
    for cmd, words in (("add-standby", "healthy NODES"), ("return-node", "evicted back")):
        res = _cli(tmp_path, cmd, "--help")
        assert res.exit_code == 0 and words in res.output and "--job" in res.output
        assert _cli(tmp_path, cmd, "--job", "j").exit_code == 2  # no NODE: a usage error
    unknown = _cli(tmp_path, "add-standby", "--job", "nope", "x1")
    assert unknown.exit_code == 1 and "no JobSpec of job 'nope'" in unknown.output

    store = ProgressStore(tmp_path / "progress.sqlite")
    store.save_spec(job_spec("j", n=2, standbys=0))
    store.step_done("d", "evict", {}, now_ms(), job="j", evicted=["j-n1"])
    store.close()
    active = _cli(tmp_path, "add-standby", "--job", "j", "j-n0")
    assert active.exit_code == 1 and "j-n0 is an active machine of job j, not a standby" in active.output
    evicted = _cli(tmp_path, "add-standby", "--job", "j", "j-n1")
    assert evicted.exit_code == 1
    assert "give it back with `trainguard actions return-node --job j j-n1`" in evicted.output
    never = _cli(tmp_path, "return-node", "--job", "j", "x1", "j-n1")
    assert never.exit_code == 1 and "x1 was not evicted from job j (evicted: ['j-n1'])" in never.output
    # nothing was written by the refused command: j-n1 is still out
    assert ProgressStore(tmp_path / "progress.sqlite").evicted_machines("j") == {"j-n1"}


def test_the_cluster_executors_say_what_their_configuration_cannot_do(tmp_path: Path) -> None:
    env = ExecutorEnv(state_dir=tmp_path)
    documented = SlurmExecutor(SlurmExecutorConfig(step_command=["train"]), env)  # the minimal config
    assert documented.unconfigured() == {"run_replay": "executor_options.replay_command is empty"}
    bare = SlurmExecutor(SlurmExecutorConfig(diagnostic_commands={}), env)
    assert sorted(bare.unconfigured()) == ["restart", "run_diagnostics", "run_replay"]
    full = KubernetesExecutorConfig(pod_template={"spec": {}}, replay_command=["replay"])
    assert KubernetesExecutor(full, env).unconfigured() == {}
    assert sorted(KubernetesExecutor(KubernetesExecutorConfig(), env).unconfigured()) == [
        "restart",
        "run_replay",
    ]
