"""The executor plugin interface: what the action service asks a cluster to do.

An executor turns recovery steps into effects on one kind of cluster: the local demo cluster
(real processes), Kubernetes, Slurm -- or nothing at all (:mod:`~trainguard.actions.executors.dry_run`).
It is a small class implementing :class:`Executor`, published by its package as an
:class:`ExecutorPlugin` under the ``trainguard.executors`` entry point group (the product never
imports an executor by name)::

    # the plugin package's pyproject.toml
    [project.entry-points."trainguard.executors"]
    slurm = "my_package.slurm:PLUGIN"

    # my_package/slurm.py
    PLUGIN = ExecutorPlugin("slurm", SlurmConfig, SlurmExecutor)

``create_executor("slurm", options, env)`` loads that entry point on first use, validates
``options`` against ``SlurmConfig`` (unknown keys are errors) and calls
``SlurmExecutor(config, env)``.  :func:`register_executor` adds a plugin in-process (embedding,
tests).

Contract for every method:

* **idempotent** -- the service records a step as done only after the call returns, so after a
  crash the step that was in flight runs again with the same ``ctx.op_id``; evicting an evicted
  machine, activating an active standby or stopping a stopped job must be harmless no-ops;
* **errors say whether to retry** -- raise :class:`~trainguard.actions.errors.TemporaryError` (``delay``
  optional) when a retry can help, :class:`~trainguard.actions.errors.PermanentError` when it cannot;
* **deadlines** -- honour ``ctx.deadline`` (``ctx.remaining()`` seconds); the service cannot kill
  a call that overruns;
* **no spec bookkeeping** -- the service computes and publishes the new JobSpec after standbys
  are swapped or provisioned; executors act on machines and processes only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from trainguard.infra.signing import Signer
from trainguard.schemas.config import ConfigError, load_config
from trainguard.schemas.control import JobSpec, stable_id


@dataclass(frozen=True)
class StepContext:
    """Which step of which recovery a call belongs to, and until when it may run."""

    decision_id: str
    step: str
    attempt: int
    #: ``time.monotonic()`` value the call must finish by.
    deadline: float
    #: the fault category the recovery answers (``gpu_unavailable``, ``job_hang``...): what an
    #: executor tells its cluster, e.g. in a drained node's reason.
    category: str = ""

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
    #: the action service's signer (``actions`` key), for commands an executor sends itself
    #: (the node agents' signed restarts); None when signing is off.
    signer: Signer | None = None


@runtime_checkable
class Executor(Protocol):
    """Effects of recovery steps on one kind of cluster (see the module docstring's contract).

    Optional beyond the protocol: ``detail(op_id) -> str``, what the executor changed for step
    ``op_id`` (e.g. the commands it ran), added to that step's action event; and
    ``ready_standbys(spec, standbys) -> list[str]``, which of the pool's ``standbys`` could take
    a place right now (a swap takes those first, and waits only for what the ready ones
    cannot cover); for topology-aware swaps (:mod:`trainguard.actions.placement`),
    ``machine_positions(names) -> {name: MachinePosition}`` (where machines sit in the network),
    ``free_machines(job) -> list[str]`` and ``provision_standbys_on(job, machines, ctx)`` (start
    standbys on the machines the planner picked).

    Optional too, so that recoveries never dead-end: ``unconfigured() -> {method: why}``, the
    methods of this protocol the executor cannot perform as configured (e.g. ``{"run_replay":
    "executor_options.replay_command is empty"}``; the plans skip the rungs needing them,
    :data:`trainguard.actions.plans.RUNG_NEEDS`); and ``usable_machines(spec, candidates, ctx) ->
    list[str]``, the machines that could take a place in the job right now -- of ``candidates``
    (the pool the service knows) and of whatever else the job's allocation holds -- asked when an
    operator released a swap that found no spare machine, instead of the pool the recovery
    started with."""

    name: str
    #: the stop-time tests :meth:`run_diagnostics` can run (``actions.diagnostics`` picks from these).
    diagnostic_tests: tuple[str, ...]

    def prepare(self) -> None:
        """Warm up before the first recovery (the service calls it once, in a background thread)."""

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

#: the entry point group executor packages publish their :class:`ExecutorPlugin` under.
ENTRY_POINT_GROUP = "trainguard.executors"


def unconfigured_commands(
    replay_command: list[str], diagnostic_commands: dict[str, list[str]], start: tuple[str, bool]
) -> dict[str, str]:
    """``Executor.unconfigured`` of an executor that runs site commands (slurm, kubernetes): the
    methods its options leave without a command, and the option to set.  ``start`` names the
    option that starts the training and whether it is set."""
    out = {}
    if not replay_command:
        out["run_replay"] = "executor_options.replay_command is empty"
    if not diagnostic_commands:
        out["run_diagnostics"] = "executor_options.diagnostic_commands is empty"
    if not start[1]:
        out["restart"] = f"executor_options.{start[0]} is empty"
    return out


@dataclass(frozen=True)
class ExecutorPlugin:
    """What an executor package publishes: its name, its config class and how to build it."""

    name: str
    config_cls: type
    factory: Factory


_REGISTRY: dict[str, ExecutorPlugin] = {}


def register_executor(plugin: ExecutorPlugin) -> None:
    """Make ``plugin`` available to :func:`create_executor` in this process (embedding, tests)."""
    _REGISTRY[plugin.name] = plugin


def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_executors() -> list[str]:
    return sorted(set(_REGISTRY) | set(_entry_points()))


def find_executor(name: str) -> ExecutorPlugin:
    """The plugin registered as ``name``, loading its entry point on first use."""
    if name not in _REGISTRY:
        ep = _entry_points().get(name)
        if ep is None:
            raise ConfigError(f"unknown executor {name!r}; available: {available_executors()}")
        plugin = ep.load()
        if not isinstance(plugin, ExecutorPlugin) or plugin.name != name:
            raise ConfigError(
                f"entry point {ENTRY_POINT_GROUP}:{name} ({ep.value}) is not an ExecutorPlugin named {name!r}"
            )
        _REGISTRY[name] = plugin
    return _REGISTRY[name]


def create_executor(name: str, options: dict[str, Any], env: ExecutorEnv) -> Executor:
    """Build the executor ``name`` from its options (validated by its config class)."""
    plugin = find_executor(name)
    config: Any = load_config(plugin.config_cls, options)
    return plugin.factory(config, env)
