"""A recovery runner on a dry-run executor and a progress store in a temporary folder, on a clock
the test moves: the guards and escalation driven step by step, without a broker."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from trainguard.actions.config import ActionsConfig
from trainguard.actions.executors.base import ExecutorEnv
from trainguard.actions.executors.dry_run import DryRunConfig, DryRunExecutor
from trainguard.actions.metrics import ActionMetrics
from trainguard.actions.progress import ProgressStore, Recovery
from trainguard.actions.recovery import RecoveryRunner
from trainguard.detectors.replay import ReplayConfig, decode_records, replay_events
from trainguard.infra.replay import read_recording
from trainguard.schemas.control import ActionEvent, Decision, Detection, JobSpec
from trainguard.schemas.enums import Action

INCIDENTS = Path(__file__).resolve().parents[1] / "fixtures" / "incidents"


class InstantStop(threading.Event):
    """The runner's stop event: its backoff waits return at once."""

    def wait(self, timeout: float | None = None) -> bool:
        return False


@dataclass
class Published:
    """What the runner publishes (Kafka in the service)."""

    actions: list[ActionEvent] = field(default_factory=list)

    def action(self, event: ActionEvent) -> None:
        self.actions.append(event)

    def job_spec(self, spec: JobSpec) -> None:
        pass  # the runner saves it in the store too, where the harness reads specs


class Harness:
    """A runner, its store, metrics and executor; ``now`` is the runner's clock (ms)."""

    def __init__(
        self,
        tmp_path: Path,
        spec: JobSpec,
        executor: DryRunExecutor | None = None,
        now: int = 1_000_000,
        **cfg: Any,
    ) -> None:
        self.now = now
        self.metrics = ActionMetrics()
        self.store = ProgressStore(tmp_path / "progress.sqlite")
        self.store.on_transition = self.metrics.transition
        self.store.save_spec(spec)
        self.executor = executor or DryRunExecutor(
            DryRunConfig(), ExecutorEnv(state_dir=tmp_path / "executor")
        )
        self.published = Published()
        self.runner = RecoveryRunner(
            ActionsConfig(spec_wait_s=0, **cfg),
            self.store,
            self.executor,
            self.published,
            self.store.spec,
            InstantStop(),
            clock=lambda: self.now,
            metrics=self.metrics,
        )

    def accept(self, *decisions: Decision) -> None:
        for d in decisions:
            assert self.store.accept(d, self.now)

    def run(self, decision: Decision) -> Recovery:
        return self.runner.run(decision.decision_id)

    def calls(self, call: str) -> list[dict[str, Any]]:
        return [r for r in self.executor.records() if r["call"] == call]

    def holds(self, guard: str, step: str) -> float:
        labels = {"guard": guard, "step": step}
        return self.metrics.registry.get_sample_value("trainguard_actions_holds_total", labels) or 0.0


@cache
def recorded_detections(fault: str) -> tuple[Detection, ...]:
    """The detections asking for an action that the recorded demo incident ``fault``
    (``tests/fixtures/incidents``) makes when replayed through the detectors."""
    config = ReplayConfig.from_worker_section(yaml.safe_load((INCIDENTS / "worker.yaml").read_text()))
    events, _ = decode_records(read_recording(INCIDENTS / f"{fault}.jsonl"))
    prior, _ = decode_records(read_recording(INCIDENTS / f"{fault}.prior.jsonl"))
    result = replay_events(events, config, prior=[d for _, d in prior if isinstance(d, Decision)])
    return tuple(d for d in result.detections if d.action not in (Action.NONE, Action.IGNORE))
