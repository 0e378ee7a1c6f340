"""Settings of the action service (`trainguard actions`): the ``actions`` section of the config
file and ``TRAINGUARD__ACTIONS__*`` variables.  One dataclass; unknown keys are errors.

The executor's own options live in ``executor_options`` and are validated by the config class the
executor registered (:mod:`trainguard.actions.executors.base`), so a Kubernetes or Slurm executor adds its
settings without touching this file.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from trainguard.detectors.placement.config import PlacementConfig
from trainguard.schemas.typecheck import bounds


@dataclass(frozen=True)
class StepPolicy:
    """Retries, backoff and timeout of one recovery step (kopf-style handler settings)."""

    #: attempts after the first one for TemporaryError (or an unexpected exception).
    retries: int = field(default=3, metadata=bounds(0, 100))
    #: first wait between attempts; doubles each time up to ``backoff_max_s``.
    backoff_s: float = field(default=1.0, metadata=bounds(0, 3600))
    backoff_max_s: float = field(default=30.0, metadata=bounds(0, 86_400))
    #: each executor call gets this deadline; executors must honour it (threads cannot be killed).
    timeout_s: float = field(default=600.0, metadata=bounds(0.1, 86_400))
    #: a TemporaryError is retried while both ``retries`` and this wall-clock budget (seconds
    #: since the step's first attempt in this run) last; then the step has failed for good.
    budget_s: float = field(default=60.0, metadata=bounds(0, 30 * 86_400))


#: Step kinds whose temporary failures take longer than a default step's to clear.  A standby's
#: start (its pool forked, its self-check passed) takes tens of seconds on a loaded machine, so
#: swapping waits up to three minutes before the recovery escalates.  ``ActionsConfig.steps``
#: overrides these per kind.
DEFAULT_STEP_POLICIES: dict[str, StepPolicy] = {
    "swap_standbys": StepPolicy(retries=100, backoff_s=2.0, backoff_max_s=10.0, budget_s=180.0),
}


@dataclass(frozen=True)
class BreakerConfig:
    """The circuit breaker on evictions (:func:`trainguard.actions.guard.breaker_trip`): evictions
    of one cause (the same detection kind and category) asking, within ``window_s`` of each other,
    for at least ``machine_share`` of a job's machines and at least ``min_machines`` of them
    suspect the detector or the environment, not the machines; they wait for an operator."""

    #: evictions of one cause whose faults (event time) lie within this long count together;
    #: 0 turns the breaker off.
    window_s: float = field(default=60.0, metadata=bounds(0, 86_400))
    #: the share of the job's machines those evictions must ask for to trip it.
    machine_share: float = field(default=0.5, metadata=bounds(0, 1))
    #: and at least this many machines (a small job's two machines are not "most of a cluster").
    min_machines: int = field(default=3, metadata=bounds(2, 1_000_000))


@dataclass(frozen=True)
class ActionsConfig:
    """The action service: consumer group, state, safety limits, standbys, diagnostics, executor."""

    #: Kafka consumer group on the decisions topic (several services with one group share jobs).
    group_id: str = "trainguard-actions"
    #: only act on these jobs (empty: every job).  Lets tests and shards share a broker.
    jobs: list[str] = field(default_factory=list)
    #: where the progress store (SQLite) lives; empty: ``<stack home>/actions``.
    state_dir: str = ""
    #: executor plugin name (``dry_run``; ``local``, ``kubernetes``, ``slurm`` register themselves).
    executor: str = "dry_run"
    #: the executor's settings, validated by the executor's registered config class.
    executor_options: dict[str, Any] = field(default_factory=dict)
    #: how long to wait for a job's JobSpec to show up on the jobs topic before failing.
    spec_wait_s: float = field(default=30.0, metadata=bounds(0, 3600))
    #: main loop poll interval (also how often held/forced-update checks run).
    poll_interval_s: float = field(default=0.5, metadata=bounds(0.01, 60))
    #: ``<namespace>/<name>`` of a Kubernetes Lease the service must hold to act (leader
    #: election among replicas, infra/k8s/lease.py); empty: no election (one replica only).
    leader_lease: str = ""
    #: kubeconfig for the Lease; empty: the in-cluster service account, else ``$KUBECONFIG``.
    leader_kubeconfig: str = ""
    #: a leader that could not renew for this long has lost (candidates wait this long).
    leader_lease_s: float = field(default=15.0, metadata=bounds(2, 600))
    #: Prometheus ``/metrics`` endpoint (:mod:`trainguard.actions.metrics`) while the service runs; "" or
    #: port 0: none.  Every interface: Prometheus scrapes it from elsewhere (the metrics carry no
    #: secret and act on nothing).  9402: beside the exporters' 9401 and the workers' 9400.
    metrics_host: str = field(default="0.0.0.0", metadata=bounds(max_len=255))
    metrics_port: int = field(default=9402, metadata=bounds(0, 65535))

    # --- safety ------------------------------------------------------------------------------
    #: a decision older than this when it first arrives is dead-lettered, not acted on: after an
    #: outage of the service, an eviction decided an hour ago describes a cluster long changed.
    max_decision_age_s: float = field(default=900.0, metadata=bounds(1, 30 * 86_400))
    #: how far in the future (by this service's clock) a decision or job spec may be dated.
    clock_skew_s: float = field(default=60.0, metadata=bounds(0, 86_400))
    #: blast-radius guard: machines one job may lose per rolling hour; more waits for an operator.
    max_evictions_per_job_hour: int = field(default=8, metadata=bounds(0, 1_000_000))
    #: the same across every job this service manages.
    max_evictions_per_hour: int = field(default=32, metadata=bounds(0, 1_000_000))
    #: circuit breaker: a burst of evictions of one cause over most of a job's machines waits
    #: for an operator (the blast-radius caps count machines, not causes).
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    #: restart budget: restarts of one job within ``restart_window_s``; more is a live-lock.
    max_restarts: int = field(default=6, metadata=bounds(0, 1_000_000))
    restart_window_s: float = field(default=3600.0, metadata=bounds(1, 30 * 86_400))

    # --- escalation (ByteRobust §4.2: diagnose -> reattempt -> rollback -> dual-phase replay) --
    #: a crash within this long after a finished recovery of the same cause (its detection's
    #: category), or after a code update, counts as "it fails again" and climbs a rung.
    escalation_window_s: float = field(default=1800.0, metadata=bounds(0, 30 * 86_400))
    #: stop-time tests run for a crash or NaN without a culprit; None: every test the executor
    #: declares (``Executor.diagnostic_tests``), ``[]``: none.  A test the executor cannot run is
    #: a configuration error when the service starts.
    diagnostics: list[str] | None = None
    #: dual-phase replay group factor k (m = k * PP, n = DP / k, m <= n).
    replay_k: int = field(default=1, metadata=bounds(1, 1 << 16))

    # --- warm standbys (§6.2) -----------------------------------------------------------------
    #: per-machine daily failure probability for the binomial P99 pool size.
    standby_p_daily: float = field(default=1.2e-3, metadata=bounds(0, 1))
    standby_quantile: float = field(default=0.99, metadata=bounds(0.5, 0.999999))
    #: pool size floor over the binomial rule (which gives 0 or 1 for small jobs).
    min_standbys: int = field(default=0, metadata=bounds(0, 10_000))
    #: which standby takes which evicted machine's place, and where new standbys go
    #: (:mod:`trainguard.detectors.placement`: Arnold's pod-spread objective; machine positions).
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    # --- code updates (§6.1) --------------------------------------------------------------------
    #: a non-urgent update waits for the next recovery, but at most this long.
    lazy_update_max_wait_s: float = field(default=24 * 3600.0, metadata=bounds(0, 365 * 86_400))

    # --- per-step retries/backoff/timeouts ------------------------------------------------------
    step: StepPolicy = field(default_factory=StepPolicy)
    #: overrides per step kind (e.g. ``diagnose: {timeout_s: 120}``).
    steps: dict[str, StepPolicy] = field(default_factory=dict)

    def diagnostic_tests(self, available: tuple[str, ...]) -> tuple[str, ...]:
        """The stop-time tests to run, given the ones the executor can run (``available``)."""
        if self.diagnostics is None:
            return available
        unknown = sorted(set(self.diagnostics) - set(available))
        if unknown:
            raise ValueError(
                f"actions.diagnostics: the executor cannot run {unknown}; it runs {list(available)}"
            )
        return tuple(self.diagnostics)

    @property
    def consumer_group(self) -> str:
        """The decisions consumer group: ``group_id``, suffixed by the job list when there is one.

        Two services with different job lists in one group would each get some partitions and
        silently drop the decisions of the other's jobs; services with the same list (a standby
        service for failover) still share a group."""
        if not self.jobs:
            return self.group_id
        digest = hashlib.sha256("\n".join(sorted(set(self.jobs))).encode()).hexdigest()[:12]
        return f"{self.group_id}-{digest}"

    def policy(self, kind: str) -> StepPolicy:
        """The retry policy of a step kind: ``steps[kind]``, else the built-in default for the
        kind (:data:`DEFAULT_STEP_POLICIES`), else ``step``."""
        if kind in self.steps:
            return self.steps[kind]
        return DEFAULT_STEP_POLICIES.get(kind, self.step)
