"""Prometheus metrics and the progress-based liveness check of a stream worker.

Liveness is judged on processing progress, not on the process being up (faust#416/#523: agents
that die or stall silently): an agent with input waiting (lag > 0) that made no progress for
``liveness_stall_s`` makes ``/healthz`` fail.  The agents share the worker's Faust consumer, so
its lag is their input; the sink has a consumer of its own, so its own lag is its input.  A sink
that keeps retrying a failed insert is waiting for ClickHouse, not stalled (a restart would not
bring ClickHouse back; ``trainguard_sink_failures_total`` says what is going on); a sink whose
loop stopped going round (a hung call, a dead thread) with records waiting is stalled.

Per training job (:class:`JobCollector`, read at every scrape from the job monitors this worker
owns): when its newest step was taken and whether a recovery works on it -- what the "job not
training" alert needs.  The label is ``training_job``, not ``job``: Prometheus gives every scraped
series a ``job`` label of its own (the scrape job), which would rename ours to ``exported_job``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # the sink process imports these metrics: not the whole detection path
    from trainguard.detectors.routing import DetectionPath

#: the sink's name in the per-agent metrics and in /healthz.
SINK = "sink"


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
        self.stage_errors = Counter(
            "trainguard_stage_errors_total",
            "Failures of an informational stage on an event another stage handled (logged)",
            ["stage"],
            registry=r,
        )
        self.input_gaps = Counter(
            "trainguard_input_gaps_total",
            "Input records delivered after records of their partition the consumer skipped",
            ["agent"],
            registry=r,
        )
        self.input_gap_records = Counter(
            "trainguard_input_gap_records_total",
            "Records of such gaps read directly and handled",
            ["agent"],
            registry=r,
        )
        self.input_gap_unread = Counter(
            "trainguard_input_gap_unread_total",
            "Records of such gaps that could not be read (logged at ERROR)",
            ["agent"],
            registry=r,
        )
        self.stuck_seeks = Counter(
            "trainguard_input_stuck_seeks_total",
            "Input partitions sought where their records stopped coming",
            registry=r,
        )
        self.decisions = Counter("trainguard_decisions_total", "Decisions emitted", ["action"], registry=r)
        self.state_writes = Counter(
            "trainguard_state_writes_total",
            "Detector state records written to the changelog",
            ["stage"],
            registry=r,
        )
        self.state_too_large = Counter(
            "trainguard_state_too_large_total",
            "Detector state records not written: over the record size limit even compressed",
            ["stage"],
            registry=r,
        )
        self.state_restores = Counter(
            "trainguard_state_restores_total",
            "Detector states restored from the changelog",
            ["stage"],
            registry=r,
        )
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
        self.sink_lag = Gauge(
            "trainguard_sink_lag", "Records the sink is behind the high watermark", ["topic"], registry=r
        )
        self.sink_buffered = Gauge(
            "trainguard_sink_buffered", "Records the sink has read but not stored yet", registry=r
        )
        self.loop_blocked = Counter(
            "trainguard_loop_blocked_seconds_total",
            "Seconds the event loop did not run, in stretches longer than loop_block_warn_s",
            registry=r,
        )
        self.followed = Gauge(
            "trainguard_follow_offset",
            "Offset of the next record this worker's own reader of a topic (jobs, control) reads",
            ["topic", "partition"],
            registry=r,
        )
        self._last_progress: dict[str, float] = {}
        #: last time an agent was seen waiting on a dependency (the sink retrying ClickHouse).
        self._waiting: dict[str, float] = {}
        self._lag: dict[str, float] = {}
        self._sink_lag: dict[str, float] = {}
        self._sink_buffered = 0

    def processed(self, agent: str, n: int = 1) -> None:
        self.events.labels(agent).inc(n)
        now = time.time()
        self._last_progress[agent] = now
        self.progress.labels(agent).set(now)

    def set_lag(self, topic: str, lag: float) -> None:
        self._lag[topic] = lag
        self.lag.labels(topic).set(lag)

    def total_lag(self) -> float:
        """Records the agents (the worker's Faust consumer) are behind."""
        return sum(self._lag.values())

    def set_sink_lag(self, lag: Mapping[str, float], buffered: int) -> None:
        for topic in set(self._sink_lag) - set(lag):  # partitions moved to another worker's sink
            self.sink_lag.labels(topic).set(0)
        self._sink_lag = dict(lag)
        for topic, n in lag.items():
            self.sink_lag.labels(topic).set(n)
        self._sink_buffered = buffered
        self.sink_buffered.set(buffered)

    def total_sink_lag(self) -> float:
        """Records the sink has not stored yet (behind the high watermark, or read and buffered)."""
        return sum(self._sink_lag.values()) + self._sink_buffered

    def waiting(self, agent: str) -> None:
        """``agent`` is alive but waiting on a dependency (not progress, not a stall)."""
        self._waiting[agent] = time.time()

    def stalled_agents(self, stall_s: float, started_at: float, sink: bool = False) -> list[str]:
        """Agents with no progress for ``stall_s`` while their input is waiting.

        ``sink``: the worker runs a sink, judged on its own lag (reported even before its first
        batch: a sink hung from the start is stalled too)."""
        now = time.time()

        def quiet(agent: str) -> bool:
            last = max(self._last_progress.get(agent, 0.0), self._waiting.get(agent, 0.0), started_at)
            return now - last > stall_s

        stalled = []
        if self.total_lag() > 0:
            stalled = [a for a in self._last_progress if a != SINK and quiet(a)]
        if sink and self.total_sink_lag() > 0 and quiet(SINK):
            stalled.append(SINK)
        return sorted(stalled)

    def health(
        self, stall_s: float, started_at: float, sink: threading.Thread | None, agents: bool = True
    ) -> dict[str, Any]:
        """The ``/healthz`` document (``ok`` false: answer 503) of a worker or of ``trainguard
        sink``.  ``sink``: the sink's thread when this process runs one (a thread that ended after
        it started makes the sink stalled); ``agents``: this process runs the agents (their lag
        is reported)."""
        stalled = self.stalled_agents(stall_s, started_at, sink is not None)
        if sink is not None and sink.ident is not None and not sink.is_alive() and SINK not in stalled:
            stalled.append(SINK)  # its thread ended while the process runs
        doc: dict[str, Any] = {"ok": not stalled, "stalled_agents": stalled}
        if agents:
            doc["lag"] = self.total_lag()
        doc["sink_lag"] = self.total_sink_lag() if sink is not None else None
        doc["uptime_s"] = round(time.time() - started_at, 1)
        return doc


@dataclass
class SinkMetrics:
    """The worker's metrics as the sink's observer (:class:`trainguard.infra.sink.SinkObserver`)."""

    metrics: WorkerMetrics

    def on_stored(self, rows: Mapping[str, int], events: int, seconds: float) -> None:
        m = self.metrics
        m.sink_latency.observe(seconds)
        for table, n in rows.items():
            m.sink_rows.labels(table).inc(n)
        m.processed(SINK, events)

    def on_failure(self, error: Exception) -> None:
        self.metrics.sink_failures.inc()
        self.metrics.waiting(SINK)

    def on_dead_letters(self, n: int) -> None:
        self.metrics.dead_letters.labels(SINK).inc(n)

    def on_lag(self, lag: Mapping[str, int], buffered: int) -> None:
        self.metrics.set_sink_lag(lag, buffered)


class JobCollector(Collector):
    """The training jobs whose monitors this worker holds (those of its steps partitions), read
    at every scrape.  Finished jobs (every rank exited 0) are left out: they are not "not
    training".  Scrapes run on the event loop (Faust's web server), where the monitors change."""

    def __init__(self, path: DetectionPath) -> None:
        self.path = path

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "trainguard_job_last_step_timestamp_seconds",
                "Unix time of the job's newest training step (any rank), as this worker has read it",
                labels=["training_job"],
            ),
            GaugeMetricFamily(
                "trainguard_job_recovering",
                "1 while a recovery works on the job or waits for an operator (the action service's events)",
                labels=["training_job"],
            ),
        )

    def describe(self) -> Iterator[Any]:
        yield from self._families()

    def collect(self) -> Iterator[Any]:
        last_step, recovering = self._families()
        now = time.time()
        silence_s = self.path.config.monitor.stopped.recovery_silence_s
        for job, monitor in list(self.path.monitors.items()):
            if monitor.last_step_ts_ms <= 0 or monitor.stopped.finished():
                continue
            last_step.add_metric([job], monitor.last_step_ts_ms / 1000)
            status = self.path.recoveries.get(job)
            recovering.add_metric([job], 1 if status is not None and status.busy(now, silence_s) else 0)
        yield from (last_step, recovering)
