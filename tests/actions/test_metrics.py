"""The action service's Prometheus metrics, counted where things happen: decisions taken in or
dead-lettered (the service), state transitions (the progress store), step attempts and holds (the
runner); the recoveries per state read from the store at every scrape; served on ``/metrics``."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.actions.conftest import Running, job_spec, make_decision
from tests.net import free_port
from tests.streams.harness import send, unique
from trainguard.actions.config import ActionsConfig
from trainguard.actions.executors.base import ExecutorEnv
from trainguard.actions.executors.dry_run import DryRunConfig, DryRunExecutor
from trainguard.actions.metrics import ActionMetrics
from trainguard.actions.progress import ProgressStore
from trainguard.actions.recovery import RecoveryRunner
from trainguard.actions.service import ActionService
from trainguard.actions.state import RecoveryState
from trainguard.infra.bus import Batch
from trainguard.infra.config import load_settings
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import ActionEvent, DeadLetter, JobSpec
from trainguard.schemas.enums import Action


class InstantStop(threading.Event):
    """The runner's stop event: its backoff waits return at once."""

    def wait(self, timeout: float | None = None) -> bool:
        return False


class Events:
    def action(self, event: ActionEvent) -> None:
        pass

    def job_spec(self, spec: JobSpec) -> None:
        pass


def value(m: ActionMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def runner_for(
    tmp_path: Path, spec: JobSpec, dry_run: DryRunConfig | None = None, **cfg: Any
) -> tuple[RecoveryRunner, ProgressStore, ActionMetrics]:
    """A runner with its store's transitions counted, as the service wires them."""
    m = ActionMetrics()
    store = ProgressStore(tmp_path / "progress.sqlite")
    store.on_transition = m.transition
    m.watch(store)
    executor = DryRunExecutor(dry_run or DryRunConfig(), ExecutorEnv(state_dir=tmp_path / "executor"))
    runner = RecoveryRunner(
        ActionsConfig(spec_wait_s=0, **cfg),
        store,
        executor,
        Events(),
        lambda _job: spec,
        InstantStop(),
        metrics=m,
    )
    return runner, store, m


def test_a_recovery_counts_its_steps_attempts_and_transitions(tmp_path: Path) -> None:
    job = "job-m"
    spec = job_spec(job, n=4, standbys=2)
    runner, store, m = runner_for(tmp_path, spec, DryRunConfig(transient_errors={"restart": 2}))
    d = make_decision(job, Action.EVICT, [f"{job}-n1"])
    assert store.accept(d, d.ts_ms)
    assert value(m, "trainguard_actions_recoveries", state="pending") == 1
    assert runner.run(d.decision_id).state is RecoveryState.SUCCEEDED

    count = "trainguard_actions_step_seconds_count"
    assert value(m, count, kind="restart", outcome="retried") == 2
    assert value(m, count, kind="restart", outcome="succeeded") == 1
    for kind in ("stop", "evict", "swap_standbys", "replenish"):
        assert value(m, count, kind=kind, outcome="succeeded") == 1, kind
    moves = "trainguard_actions_recovery_transitions_total"
    walk = ["pending", "stopping", "evicting", "swapping", "restarting", "replenishing", "succeeded"]
    for old, new in itertools.pairwise(walk):
        assert value(m, moves, from_state=old, to_state=new) == 1, (old, new)
    # Nothing open any more: every state reads 0, and no "oldest" series is left.
    assert all(
        value(m, "trainguard_actions_recoveries", state=s) == 0 for s in ("pending", "held", "restarting")
    )
    assert value(m, "trainguard_actions_recovery_oldest_start_timestamp_seconds", state="restarting") is None
    assert value(m, "trainguard_actions_held_recoveries") == 0 and value(m, "trainguard_actions_paused") == 0


HOLDS: list[tuple[str, Action, str, dict[str, Any], DryRunConfig | None]] = [
    ("blast_radius", Action.EVICT, "evict", {"max_evictions_per_job_hour": 1}, None),
    ("restart_budget", Action.RESTART, "stop", {"max_restarts": 0}, None),
    ("step_failed", Action.EVICT, "evict", {}, DryRunConfig(permanent_errors=["evict"])),
    ("plan", Action.DIAGNOSE, "plan", {}, None),  # the ladder is spent: the plan holds
]


@pytest.mark.parametrize(("guard", "action", "step", "cfg", "dry_run"), HOLDS, ids=[h[0] for h in HOLDS])
def test_each_hold_is_counted_by_guard_and_the_store_reports_it_held(
    tmp_path: Path, guard: str, action: Action, step: str, cfg: dict[str, Any], dry_run: DryRunConfig | None
) -> None:
    job = "job-h"
    runner, store, m = runner_for(tmp_path, job_spec(job), dry_run, **cfg)
    if guard == "plan":  # a recovery just ended at the ladder's last rung: the next crash needs an operator
        spent = make_decision(job, Action.DIAGNOSE)
        assert store.accept(spent, spent.ts_ms - 10)
        store.transition(
            spent.decision_id, RecoveryState.SUCCEEDED, finished_ms=spent.ts_ms - 5, next_level=3
        )
    d = make_decision(job, action, [f"{job}-n0", f"{job}-n1"] if action is Action.EVICT else None)
    assert store.accept(d, d.ts_ms)
    rec = runner.run(d.decision_id)
    assert rec.state is RecoveryState.HELD
    assert value(m, "trainguard_actions_holds_total", guard=guard, step=step) == 1
    assert value(m, "trainguard_actions_held_recoveries") == 1
    assert value(m, "trainguard_actions_recoveries", state="held") == 1
    since = value(m, "trainguard_actions_recovery_oldest_start_timestamp_seconds", state="held")
    assert since is not None and abs(since * 1000 - (rec.started_ms or rec.accepted_ms)) < 1
    if guard == "step_failed":
        assert value(m, "trainguard_actions_step_seconds_count", kind="evict", outcome="failed") == 1
    if guard == "blast_radius":  # an operator's release is a transition too
        store.release(d.decision_id)
        held_to = "trainguard_actions_recovery_transitions_total"
        assert value(m, held_to, from_state="held", to_state="evicting") == 1
        assert runner.run(d.decision_id).state is RecoveryState.SUCCEEDED
        assert value(m, "trainguard_actions_held_recoveries") == 0


class OneBatch:
    """The decisions consumer, handing over one batch."""

    def __init__(self, batch: Batch) -> None:
        self.batches = [batch]
        self.commits = 0

    def poll(self, timeout_ms: int = 1000) -> Batch:
        return self.batches.pop(0) if self.batches else Batch([], [])

    def commit(self) -> None:
        self.commits += 1

    def seek_back(self, records: Sequence[Any]) -> None:
        pass

    def close(self) -> None:
        pass


class Producer:
    """Takes the dead letters the service publishes."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, event: Any, topic: Any = None) -> None:
        self.sent.append(event)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_decisions_taken_in_are_counted_and_served_over_http(tmp_path: Path) -> None:
    base = load_settings(environ={})
    settings = dataclasses.replace(
        base,
        stack=dataclasses.replace(base.stack, home=str(tmp_path / "home")),
        signing=dataclasses.replace(base.signing, enabled=False),
    )
    port = free_port()
    cfg = ActionsConfig(state_dir=str(tmp_path / "actions"), metrics_host="127.0.0.1", metrics_port=port)
    producer = Producer()
    executor = DryRunExecutor(DryRunConfig(), ExecutorEnv(state_dir=tmp_path / "executor"))
    service = ActionService(settings, cfg, executor=executor, producer=producer)  # type: ignore[arg-type]
    fresh = make_decision("job-a", Action.RESTART)
    stale = dataclasses.replace(make_decision("job-a", Action.RESTART), ts_ms=now_ms() - 3_600_000)
    garbage = [
        DeadLetter(ts_ms=now_ms(), topic="trainguard.control.decisions", reason="not JSON", stage=stage)
        for stage in ("decode", "auth")
    ]
    service._consumer = OneBatch(Batch([fresh, fresh, stale], garbage))
    try:
        assert service.take_decisions(0)
        m = service.metrics
        assert value(m, "trainguard_actions_decisions_received_total") == 5
        assert value(m, "trainguard_actions_decisions_accepted_total") == 1
        assert value(m, "trainguard_actions_decisions_redelivered_total") == 1
        for reason in ("badly_dated", "decode", "auth"):
            assert value(m, "trainguard_actions_decisions_rejected_total", reason=reason) == 1, reason
        assert value(m, "trainguard_actions_decisions_rejected_total", reason="invalid") == 0
        assert value(m, "trainguard_actions_dead_letters_total", stage="actions:accept") == 1
        assert [dl.stage for dl in producer.sent] == ["actions:accept"]  # the other two: the consumer's

        assert service.serve_metrics() == port
        text = scrape(port)
        assert "trainguard_actions_decisions_accepted_total 1.0" in text
        assert 'trainguard_actions_recoveries{state="pending"} 1.0' in text
        assert 'trainguard_actions_decisions_rejected_total{reason="badly_dated"} 1.0' in text
        assert "trainguard_actions_paused 0.0" in text
    finally:
        service.shutdown()
    with pytest.raises(urllib.error.URLError):
        scrape(port)  # closed with the service, before its store


@pytest.mark.slow
def test_the_running_service_serves_its_metrics(start_service: Callable[..., Running]) -> None:
    job = unique("job-metrics")
    port = free_port()
    run = start_service([job], metrics_host="127.0.0.1", metrics_port=port)
    send(run.settings, job_spec(job, n=4, standbys=2))
    d = make_decision(job, Action.EVICT, [f"{job}-n2"])
    send(run.settings, d)
    assert run.wait(d.decision_id).state is RecoveryState.SUCCEEDED
    text = scrape(port)
    assert "trainguard_actions_decisions_accepted_total 1.0" in text
    assert (
        'trainguard_actions_recovery_transitions_total{from_state="replenishing",to_state="succeeded"} 1.0'
        in text
    )
    assert 'trainguard_actions_step_seconds_count{kind="evict",outcome="succeeded"} 1.0' in text
    assert 'trainguard_actions_recoveries{state="pending"} 0.0' in text
