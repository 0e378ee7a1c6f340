"""A recovery step's retries wait by the step policy's backoff (no broker: the runner alone)."""

from __future__ import annotations

import threading
from pathlib import Path

from tests.actions.conftest import job_spec, make_decision
from trainguard.actions.config import ActionsConfig, StepPolicy
from trainguard.actions.errors import TemporaryError
from trainguard.actions.executors.base import ExecutorEnv, StepContext
from trainguard.actions.executors.dry_run import DryRunConfig, DryRunExecutor
from trainguard.actions.progress import ProgressStore
from trainguard.actions.recovery import RecoveryRunner
from trainguard.actions.state import RecoveryState
from trainguard.schemas.control import ActionEvent, JobSpec
from trainguard.schemas.enums import Action


class RecordingStop(threading.Event):
    """A stop event whose waits return at once and are recorded (the backoff under test)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(float(timeout or 0.0))
        return False


class FlakyRestart(DryRunExecutor):
    """``restart`` fails with these delays (None: no delay asked) before it succeeds."""

    def __init__(self, env: ExecutorEnv, delays: list[float | None]) -> None:
        super().__init__(DryRunConfig(), env)
        self.delays = list(delays)

    def restart(self, spec: JobSpec, ctx: StepContext) -> None:
        if self.delays:
            raise TemporaryError("not yet", delay=self.delays.pop(0))
        super().restart(spec, ctx)


class Events:
    def __init__(self) -> None:
        self.actions: list[ActionEvent] = []

    def action(self, event: ActionEvent) -> None:
        self.actions.append(event)

    def job_spec(self, spec: JobSpec) -> None:
        pass


def test_step_retries_back_off_exponentially_and_honour_the_executors_delay(tmp_path: Path) -> None:
    job = "job-retries"
    spec = job_spec(job)
    cfg = ActionsConfig(step=StepPolicy(retries=6, backoff_s=1.0, backoff_max_s=4.0), spec_wait_s=0)
    executor = FlakyRestart(ExecutorEnv(state_dir=tmp_path / "executor"), [None, None, 10.0, None, None])
    store, stop, events = ProgressStore(tmp_path / "progress.sqlite"), RecordingStop(), Events()
    runner = RecoveryRunner(cfg, store, executor, events, lambda _job: spec, stop=stop)
    decision = make_decision(job, Action.DIAGNOSE)
    assert store.accept(decision, decision.ts_ms)
    rec = runner.run(decision.decision_id)
    assert rec.state is RecoveryState.SUCCEEDED
    # 1, 2, then the executor's 10 s, then doubling from it, capped at 4 s.
    assert stop.waits == [1.0, 2.0, 10.0, 4.0, 4.0]
    failed = [e.detail for e in events.actions if e.step == "restart" and e.phase.value == "failed"]
    assert [d.rsplit("retrying in ", 1)[-1] for d in failed] == ["1 s", "2 s", "10 s", "4 s", "4 s"]


class AdvancingStop(RecordingStop):
    """Each wait moves the runner's clock on by the time waited."""

    def __init__(self) -> None:
        super().__init__()
        self.now_ms = 1_000_000

    def wait(self, timeout: float | None = None) -> bool:
        self.now_ms += int(float(timeout or 0.0) * 1000)
        return super().wait(timeout)


def test_a_temporary_error_is_retried_within_the_steps_budget_then_the_recovery_is_held(
    tmp_path: Path,
) -> None:
    job = "job-budget"
    spec = job_spec(job)
    cfg = ActionsConfig(
        steps={"restart": StepPolicy(retries=100, backoff_s=10.0, backoff_max_s=10.0, budget_s=35.0)},
        spec_wait_s=0,
    )
    executor = FlakyRestart(ExecutorEnv(state_dir=tmp_path / "executor"), [None] * 50)
    store, stop, events = ProgressStore(tmp_path / "progress.sqlite"), AdvancingStop(), Events()
    runner = RecoveryRunner(
        cfg, store, executor, events, lambda _job: spec, stop=stop, clock=lambda: stop.now_ms
    )
    decision = make_decision(job, Action.DIAGNOSE)
    assert store.accept(decision, decision.ts_ms)
    rec = runner.run(decision.decision_id)
    # Attempts at 0, 10, 20, 30 and 40 s: the fifth failure finds the 35 s budget spent.
    assert stop.waits == [10.0, 10.0, 10.0, 10.0]
    assert rec.state is RecoveryState.HELD and rec.held_step == "restart"
    assert "needed: the job restarted on healthy machines" in rec.held_reason
    held = [e for e in events.actions if e.phase.value == "held"]
    assert [e.step for e in held] == ["restart"]


def test_swapping_standbys_waits_minutes_by_default_not_seconds() -> None:
    """A standby's start under load takes tens of seconds: the default swap budget covers it."""
    swap = ActionsConfig().policy("swap_standbys")
    assert swap.budget_s >= 120 and swap.retries >= 30
    assert (
        ActionsConfig(steps={"swap_standbys": StepPolicy(budget_s=5)}).policy("swap_standbys").budget_s == 5
    )


class ReadinessAware(DryRunExecutor):
    """A dry run whose standbys in ``starting`` are not ready yet: activating one is retried."""

    def __init__(self, env: ExecutorEnv, starting: set[str], probe_fails: bool = False) -> None:
        super().__init__(DryRunConfig(), env)
        self.starting, self.probe_fails = starting, probe_fails
        self.activated: list[list[str]] = []

    def ready_standbys(self, spec: JobSpec, standbys: list[str]) -> list[str]:
        if self.probe_fails:
            raise OSError("cluster state unreadable")
        return [s for s in standbys if s not in self.starting]

    def activate_standbys(
        self, spec: JobSpec, standbys: list[str], replaces: list[str], ctx: StepContext
    ) -> None:
        self.activated.append(list(standbys))
        if self.starting & set(standbys):
            raise TemporaryError(
                f"standby machines {sorted(self.starting & set(standbys))} have not started yet"
            )
        super().activate_standbys(spec, standbys, replaces, ctx)


def _evict_with(tmp_path: Path, executor: ReadinessAware, spec: JobSpec) -> tuple[RecordingStop, list[str]]:
    cfg = ActionsConfig(spec_wait_s=0, min_standbys=1)
    store, stop = ProgressStore(tmp_path / "progress.sqlite"), RecordingStop()
    runner = RecoveryRunner(cfg, store, executor, Events(), lambda _job: spec, stop=stop)
    decision = make_decision(spec.job, Action.EVICT, [f"{spec.job}-n2"])
    assert store.accept(decision, decision.ts_ms)
    assert runner.run(decision.decision_id).state is RecoveryState.SUCCEEDED
    return stop, executor.activated[-1]


def test_a_swap_takes_a_ready_standby_before_one_still_starting(tmp_path: Path) -> None:
    """The pool lists warm0 (still starting: provisioned after the last eviction) before warm1
    (ready): the swap takes warm1 at once instead of waiting for warm0."""
    spec = job_spec("job-ready-first", standbys=2)
    executor = ReadinessAware(ExecutorEnv(state_dir=tmp_path / "executor"), {"job-ready-first-warm0"})
    stop, chosen = _evict_with(tmp_path, executor, spec)
    assert chosen == ["job-ready-first-warm1"] and executor.activated == [chosen]
    assert stop.waits == []  # no retry: nothing waited for


def test_a_swap_waits_for_a_starting_standby_when_no_ready_one_is_left(tmp_path: Path) -> None:
    spec = job_spec("job-none-ready", standbys=1)
    executor = ReadinessAware(ExecutorEnv(state_dir=tmp_path / "executor"), {"job-none-ready-warm0"})
    calls = {"n": 0}
    original = executor.activate_standbys

    def becomes_ready(spec: JobSpec, standbys: list[str], replaces: list[str], ctx: StepContext) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            executor.starting.clear()  # its pool came up while the swap waited
        original(spec, standbys, replaces, ctx)

    executor.activate_standbys = becomes_ready  # type: ignore[method-assign]
    stop, chosen = _evict_with(tmp_path, executor, spec)
    assert chosen == ["job-none-ready-warm0"] and len(stop.waits) == 2


def test_a_failing_readiness_probe_costs_the_preference_not_the_swap(tmp_path: Path) -> None:
    spec = job_spec("job-probe-fails", standbys=2)
    executor = ReadinessAware(ExecutorEnv(state_dir=tmp_path / "executor"), set(), probe_fails=True)
    _, chosen = _evict_with(tmp_path, executor, spec)
    assert chosen == ["job-probe-fails-warm0"]  # pool order
