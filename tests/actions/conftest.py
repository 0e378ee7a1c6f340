"""Fixtures for action-service tests: a real service (in a thread) against the real broker.

Each test uses its own job names, consumer group and state directory, so tests share the broker
(and its retained history) without seeing each other's decisions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.streams.harness import Watcher, send, unique
from tests.waiting import wait_until
from trainguard.actions.config import ActionsConfig
from trainguard.actions.executors.base import ExecutorEnv
from trainguard.actions.executors.dry_run import DryRunConfig, DryRunExecutor
from trainguard.actions.progress import Recovery
from trainguard.actions.service import ActionService
from trainguard.infra.config import Settings
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import Decision, JobSpec, Targets
from trainguard.schemas.enums import Action
from trainguard.schemas.topics import ACTIONS, JOBS
from trainguard.schemas.topology import JobTopology


def job_spec(job: str, n: int = 4, standbys: int = 2, pp: int = 1) -> JobSpec:
    topo = JobTopology(
        job=job, tp=1, pp=pp, dp=n // pp, ranks_per_machine=1, machines=[f"{job}-n{i}" for i in range(n)]
    )
    return JobSpec(
        job=job, ts_ms=now_ms(), topology=topo, standbys=[f"{job}-warm{i}" for i in range(standbys)]
    )


def make_decision(job: str, action: Action, machines: list[str] | None = None, **evidence: Any) -> Decision:
    return Decision(
        decision_id=unique("dec"),
        ts_ms=now_ms(),
        job=job,
        action=action,
        targets=Targets(machines=machines or [], group_kind="machine" if machines else "job"),
        reason="test",
        evidence=dict(evidence),
    )


@dataclass
class Running:
    service: ActionService
    executor: DryRunExecutor
    thread: threading.Thread
    stop: threading.Event
    settings: Settings

    def wait(self, decision_id: str, timeout_s: float = 30.0, states: tuple[str, ...] = ()) -> Recovery:
        """Wait until the recovery is terminal (or in one of ``states``)."""

        def reached() -> Recovery | None:
            rec = self.service.store.get(decision_id)
            if rec is not None and (rec.state.value in states or (not states and rec.state.terminal)):
                return rec
            return None

        return wait_until(
            reached,
            timeout_s,
            lambda: (
                f"recovery {decision_id} {'in ' + '/'.join(states) if states else 'to finish'}; "
                f"last seen: {self.service.store.get(decision_id)}"
            ),
        )

    def calls(self, call: str, job: str) -> list[dict[str, Any]]:
        return [r for r in self.executor.records() if r["call"] == call and r["job"] == job]


@pytest.fixture
def start_service(stack_settings: Settings, tmp_path: Path) -> Iterator[Callable[..., Running]]:
    started: list[Running] = []

    def start(
        jobs: list[str],
        dry_run: DryRunConfig | None = None,
        settings: Settings | None = None,
        **overrides: Any,
    ) -> Running:
        settings = settings or stack_settings
        cfg = ActionsConfig(
            group_id=unique("tg-actions-test"),
            jobs=jobs,
            state_dir=str(tmp_path / "actions"),
            poll_interval_s=0.2,
            spec_wait_s=20,
            **{"min_standbys": 1, **overrides},
        )
        env = ExecutorEnv(state_dir=tmp_path / "actions" / "executor")
        executor = DryRunExecutor(dry_run or DryRunConfig(), env)
        service = ActionService(settings, cfg, executor=executor)
        service.start_consuming()
        stop = threading.Event()
        thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
        thread.start()
        run = Running(service, executor, thread, stop, settings)
        started.append(run)
        return run

    yield start
    for run in started:
        run.stop.set()
        run.thread.join(30)


@pytest.fixture
def actions_watch(stack_settings: Settings) -> Iterator[Watcher]:
    w = Watcher(stack_settings, ACTIONS)
    yield w
    w.close()


@pytest.fixture
def jobs_watch(stack_settings: Settings) -> Iterator[Watcher]:
    w = Watcher(stack_settings, JOBS)
    yield w
    w.close()


__all__ = ["job_spec", "make_decision", "send", "unique"]
