"""The executor plugin interface: what the action service asks a cluster to do.

An executor turns recovery steps into effects on one kind of cluster: the local demo cluster
(real processes), Kubernetes, Slurm -- or nothing at all (:mod:`~actions.executors.dry_run`).
It is a small class implementing :class:`Executor`, registered by name with its own frozen config
dataclass::

    register_executor("slurm", SlurmConfig, SlurmExecutor)

``create_executor("slurm", options, env)`` imports ``actions.executors.slurm`` on first use (so a
plugin module only has to exist), validates ``options`` against ``SlurmConfig`` (unknown keys are
errors) and calls ``SlurmExecutor(config, env)``.

Contract for every method:

* **idempotent** -- the service records a step as done only after the call returns, so after a
  crash the step that was in flight runs again with the same ``ctx.op_id``; evicting an evicted
  machine, activating an active standby or stopping a stopped job must be harmless no-ops;
* **errors say whether to retry** -- raise :class:`~actions.errors.TemporaryError` (``delay``
  optional) when a retry can help, :class:`~actions.errors.PermanentError` when it cannot;
* **deadlines** -- honour ``ctx.deadline`` (``ctx.remaining()`` seconds); the service cannot kill
  a call that overruns;
* **no spec bookkeeping** -- the service computes and publishes the new JobSpec after standbys
  are swapped or provisioned; executors act on machines and processes only.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from schemas.config import ConfigError, load_config
from schemas.control import JobSpec, stable_id


@dataclass(frozen=True)
class StepContext:
    """Which step of which recovery a call belongs to, and until when it may run."""

    decision_id: str
    step: str
    attempt: int
    #: ``time.monotonic()`` value the call must finish by.
    deadline: float

    @property
    def op_id(self) -> str:
        """Same for every attempt of this step: an executor may use it to deduplicate."""
        return stable_id(self.decision_id, self.step)

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


@dataclass(frozen=True)
class DiagnosticResult:
    """One stop-time test on one machine."""

    machine: str
    test: str  # alignment / connectivity
    passed: bool
    detail: str = ""
    duration_ms: float = 0.0


@dataclass(frozen=True)
class ExecutorEnv:
    """What the service hands every executor: a private state directory and its settings."""

    state_dir: Path
    kafka_bootstrap: str = ""


@runtime_checkable
class Executor(Protocol):
    """Effects of recovery steps on one kind of cluster (see the module docstring's contract)."""

    name: str

    def stop(self, spec: JobSpec, ctx: StepContext) -> None:
        """Stop every training process of the job (machines stay allocated)."""

    def evict(self, spec: JobSpec, machines: list[str], ctx: StepContext) -> None:
        """Take ``machines`` out of the job and block them (cordon, drain, exclude)."""

    def provision_standbys(self, job: str, count: int, ctx: StepContext) -> list[str]:
        """Start ``count`` new warm standbys (self-check, then wait); return their names."""
        ...

    def activate_standbys(
        self, spec: JobSpec, standbys: list[str], replaces: list[str], ctx: StepContext
    ) -> None:
        """Wake ``standbys`` to take the places of ``replaces`` (same order) in the job."""

    def restart(self, spec: JobSpec, ctx: StepContext) -> None:
        """Start the job on ``spec.topology.machines`` from the latest complete checkpoint."""

    def hot_update(self, spec: JobSpec, version: str, ctx: StepContext) -> None:
        """Switch the job's code to ``version`` in place (no rescheduling); also used to roll back."""

    def run_diagnostics(
        self, spec: JobSpec, machines: list[str], tests: list[str], ctx: StepContext
    ) -> list[DiagnosticResult]:
        """Run the stop-time ``tests`` on ``machines``; one result per (machine, test)."""
        ...

    def run_replay(self, spec: JobSpec, groups: list[list[str]], ctx: StepContext) -> list[bool]:
        """Replay the job (fewer layers, same TP/PP) on each machine group; True = it passed."""
        ...

    def close(self) -> None:
        """Release clients and threads (the service is stopping)."""


Factory = Callable[[Any, ExecutorEnv], Executor]
_REGISTRY: dict[str, tuple[type, Factory]] = {}


def register_executor(name: str, config_cls: type, factory: Factory) -> None:
    """Make ``name`` available to :func:`create_executor` (a plugin module calls this on import)."""
    _REGISTRY[name] = (config_cls, factory)


def available_executors() -> list[str]:
    return sorted(_REGISTRY)


def create_executor(name: str, options: dict[str, Any], env: ExecutorEnv) -> Executor:
    """Build the executor ``name`` from its options (validated by its config class)."""
    if name not in _REGISTRY:
        try:
            importlib.import_module(f"actions.executors.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"actions.executors.{name}":
                raise
    if name not in _REGISTRY:
        raise ConfigError(f"unknown executor {name!r}; available: {available_executors()}")
    config_cls, factory = _REGISTRY[name]
    config: Any = load_config(config_cls, options)
    return factory(config, env)
