"""Prometheus metrics and the progress-based liveness check of a stream worker.

Liveness is judged on processing progress, not on the process being up (faust#416/#523: agents
that die or stall silently): an agent with input waiting (lag > 0) that made no progress for
``liveness_stall_s`` makes ``/healthz`` fail.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass
class WorkerMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.events = Counter("trainguard_agent_events_total", "Events processed", ["agent"], registry=r)
        self.dead_letters = Counter(
            "trainguard_dead_letters_total", "Events dead-lettered", ["agent"], registry=r
        )
        self.detections = Counter("trainguard_detections_total", "Detections emitted", ["agent"], registry=r)
        self.decisions = Counter("trainguard_decisions_total", "Decisions emitted", ["action"], registry=r)
        self.lag = Gauge(
            "trainguard_consumer_lag", "Records behind the high watermark", ["topic"], registry=r
        )
        self.progress = Gauge(
            "trainguard_agent_last_progress_seconds", "Unix time of last progress", ["agent"], registry=r
        )
        self.sink_latency = Histogram(
            "trainguard_sink_batch_seconds",
            "ClickHouse batch insert latency",
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.sink_rows = Counter(
            "trainguard_sink_rows_total", "Rows written to ClickHouse", ["table"], registry=r
        )
        self.sink_failures = Counter(
            "trainguard_sink_failures_total", "Failed ClickHouse inserts", registry=r
        )
        self._last_progress: dict[str, float] = {}
        self._lag: dict[str, float] = {}

    def processed(self, agent: str, n: int = 1) -> None:
        self.events.labels(agent).inc(n)
        now = time.time()
        self._last_progress[agent] = now
        self.progress.labels(agent).set(now)

    def set_lag(self, topic: str, lag: float) -> None:
        self._lag[topic] = lag
        self.lag.labels(topic).set(lag)

    def total_lag(self) -> float:
        return sum(self._lag.values())

    def stalled_agents(self, stall_s: float, started_at: float) -> list[str]:
        """Agents with no progress for ``stall_s`` while input is waiting."""
        if self.total_lag() <= 0:
            return []
        now = time.time()
        return sorted(a for a, t in self._last_progress.items() if now - max(t, started_at) > stall_s)
