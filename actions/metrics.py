"""Prometheus metrics of the action service, served on ``actions.metrics_host:metrics_port``.

Counters are kept where things happen (decisions taken in, state transitions, step attempts,
holds, dead letters).  The recoveries *now* in each state are read from the progress store at
every scrape (:class:`StoreCollector`), not counted in memory: the store is the truth, and an
operator's ``trainguard actions release`` / ``cancel`` changes it from another process.

Label values are bounded: ``state`` a :class:`~trainguard.actions.state.RecoveryState`, ``kind``/``step`` a
step kind (or ``plan`` for a hold by the plan itself), ``guard`` one of :data:`GUARDS`,
``reason`` one of :data:`REJECT_REASONS`, ``stage`` a dead-letter stage of this service.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from trainguard.actions.progress import ProgressStore
from trainguard.actions.state import TERMINAL, RecoveryState

log = logging.getLogger(__name__)

#: why a recovery waits for an operator: the blast-radius cap on evictions, the circuit breaker (a
#: burst of evictions of one cause), the restart budget, a step that failed for good, the plan
#: itself (e.g. nothing left to try).
GUARDS = ("blast_radius", "breaker", "restart_budget", "step_failed", "plan")
#: why a decision was dead-lettered instead of acted on: undecodable, a failed signature, dated
#: too far in the past or future, failed when recorded.
REJECT_REASONS = ("decode", "auth", "badly_dated", "invalid")
#: outcomes of one attempt of a step (``outcome`` of the step histogram): done; failed and tried
#: again; failed for good (the recovery is held, or a replenish let go).
STEP_OUTCOMES = ("succeeded", "retried", "failed")
#: the states a recovery is in while it is not finished (the ``state`` label of the gauges).
OPEN_STATES = tuple(s for s in RecoveryState if s not in TERMINAL)


@dataclass
class ActionMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.decisions_received = Counter(
            "trainguard_actions_decisions_received_total",
            "Decision records read from the decisions topic (undecodable ones included)",
            registry=r,
        )
        self.decisions_accepted = Counter(
            "trainguard_actions_decisions_accepted_total",
            "Decisions recorded as new recoveries (forced code updates included)",
            registry=r,
        )
        self.decisions_redelivered = Counter(
            "trainguard_actions_decisions_redelivered_total",
            "Decisions read again that the store already had (no new recovery)",
            registry=r,
        )
        self.decisions_rejected = Counter(
            "trainguard_actions_decisions_rejected_total",
            "Decisions dead-lettered instead of acted on, by reason",
            ["reason"],
            registry=r,
        )
        self.dead_letters = Counter(
            "trainguard_actions_dead_letters_total",
            "Records (decisions, job specs) and crashed recoveries dead-lettered, by stage",
            ["stage"],
            registry=r,
        )
        self.transitions = Counter(
            "trainguard_actions_recovery_transitions_total",
            "Recovery state changes made by this service",
            ["from_state", "to_state"],
            registry=r,
        )
        self.step_seconds = Histogram(
            "trainguard_actions_step_seconds",
            "Duration of one attempt of a recovery step, by step kind and outcome",
            ["kind", "outcome"],
            registry=r,
            # From a ConfigMap patch (milliseconds) to stopping and restarting thousands of ranks
            # or a diagnostics run (minutes).
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800),
        )
        self.holds = Counter(
            "trainguard_actions_holds_total",
            "Recoveries held for an operator, by guard and the step held at",
            ["guard", "step"],
            registry=r,
        )
        self.crashes = Counter(
            "trainguard_actions_recovery_crashes_total",
            "Runs of a recovery that raised (retried; failed and dead-lettered after the third)",
            registry=r,
        )
        for reason in REJECT_REASONS:  # every series exists from the start: rate() sees the first one
            self.decisions_rejected.labels(reason)

    def transition(self, old: RecoveryState, new: RecoveryState) -> None:
        """A recovery moved from ``old`` to ``new`` (the progress store's hook)."""
        if old is not new:
            self.transitions.labels(old.value, new.value).inc()

    def step(self, kind: str, outcome: str, seconds: float) -> None:
        self.step_seconds.labels(kind, outcome).observe(max(0.0, seconds))

    def held(self, guard: str, step: str) -> None:
        self.holds.labels(guard, step).inc()

    def watch(self, store: ProgressStore) -> None:
        """Report ``store``'s recoveries at every scrape."""
        self.registry.register(StoreCollector(store))


class StoreCollector(Collector):
    """The recoveries in the progress store now: per open state, how many and since when."""

    def __init__(self, store: ProgressStore) -> None:
        self.store = store

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "trainguard_actions_recoveries", "Recoveries not finished, by state", labels=["state"]
            ),
            GaugeMetricFamily(
                "trainguard_actions_recovery_oldest_start_timestamp_seconds",
                "Unix time the oldest recovery in a state started (accepted, if it has not started)",
                labels=["state"],
            ),
            GaugeMetricFamily("trainguard_actions_held_recoveries", "Recoveries held for an operator"),
            GaugeMetricFamily("trainguard_actions_paused", "1 while an operator has paused the service"),
        )

    def describe(self) -> Iterator[Any]:
        # The names only: the registry checks them for clashes without querying the store.
        yield from self._families()

    def collect(self) -> Iterator[Any]:
        count, oldest, held, paused = self._families()
        try:
            by_state = self.store.open_by_state()
            is_paused = self.store.paused() is not None
        except Exception as exc:  # a scrape must not fail on a store that is away: these gauges
            log.warning("metrics: reading the progress store failed: %s", exc)  # are absent this once
            return
        for state in OPEN_STATES:
            n, since_ms = by_state.get(state, (0, None))
            count.add_metric([state.value], n)
            if since_ms is not None:
                oldest.add_metric([state.value], since_ms / 1000)
        held.add_metric([], by_state.get(RecoveryState.HELD, (0, None))[0])
        paused.add_metric([], 1 if is_paused else 0)
        yield from (count, oldest, held, paused)
