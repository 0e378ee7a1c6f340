"""Offline replay of a recorded incident through the stream worker's detectors: no Kafka, no Faust.

:func:`replay_events` feeds recorded events, in order, through the same detector objects the
worker's agents (``streams/agents/``) use, wired the same way:

* inspection -- one :class:`~detectors.node_inspector.NodeInspector` for GPU, NIC and host samples
  and log lines;
* anomaly -- one :class:`~detectors.node_anomaly.NodeAnomalyScorer` for GPU samples (informational
  detections only);
* training -- one :class:`~detectors.job_monitor.JobMonitor` per job for steps and exits (exits
  without a job are skipped), asked for time-based findings every ``check_interval_s``;
* decide -- one :class:`~detectors.decide.DecisionPolicy` for every detection; a node-less
  eviction is localised with the job's latest :class:`~schemas.control.JobSpec` seen so far (the
  agent asks the job directory, which the sink fills from the same jobs topic);
* aggregation -- :class:`~detectors.capture.Captures`: an ``aggregate`` decision (made here or
  recorded) opens a capture, captures are closed and analysed on a 1 s tick.  The capture
  commands are not sent anywhere: the recorded stack dumps answer them.  They carry the capture
  id of the live run, so a job's dumps are filed under the job's pending capture (there is one
  capture per job at a time).

State from before the recording that shapes what happens in it -- the decisions already made,
which de-duplicate repeats, and the last capture's time (cooldown) -- is passed in as ``prior``
decisions.  Differences from the live worker, on purpose: the clock is the records' own
timestamps (the Kafka record time, when the event reached the broker), not the wall clock, so
the worker's processing lag is not replayed; timers fire at every multiple of their interval
between two records and stop at the last record (except the capture timer, which runs on to
close open captures); an emitted detection reaches the decide step, and a decision the
aggregation step, at once instead of through Kafka.  Recorded detections are ignored (this
pipeline makes its own); commands, actions and heartbeats are not inputs of any detector.
Garbage records are returned as rejects, as the agents skip them (the sink dead-letters them).
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from detectors.capture import AggregationConfig, Captures
from detectors.decide import DecideConfig, DecisionPolicy
from detectors.job_monitor import JobMonitor, MonitorConfig
from detectors.node_anomaly import NodeAnomalyScorer
from detectors.node_inspector import HostThresholds, NodeInspector
from schemas.base import Event
from schemas.codec import DecodeError, decode
from schemas.config import load_config
from schemas.control import Decision, Detection, JobSpec
from schemas.enums import Action
from schemas.telemetry import GpuSampleBatch
from schemas.topics import BY_NAME
from schemas.topology import JobTopology
from schemas.typecheck import rng
from schemas.workload import ProcessExit, StackDump, TrainingStep

#: the aggregation agent's timer period (it closes due captures).
CAPTURE_TICK_MS = 1000


@dataclass(frozen=True)
class ReplayConfig:
    """The detector settings of a worker config (same names as its ``worker`` section)."""

    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    decide: DecideConfig = field(default_factory=DecideConfig)
    host: HostThresholds = field(default_factory=HostThresholds)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    check_interval_s: float = field(default=2.0, metadata=rng(0.1, 600))
    anomaly_detector: str = "ewma_zscore"
    anomaly_threshold: float = field(default=8.0, metadata=rng(0, 1e9))

    @classmethod
    def from_worker_section(cls, worker: Mapping[str, Any]) -> ReplayConfig:
        """From a config file's ``worker`` section; its non-detector keys (app id, sink...) are ignored."""
        names = {f.name for f in fields(cls)}
        return load_config(cls, {k: v for k, v in worker.items() if k in names})


@dataclass
class ReplayResult:
    detections: list[Detection] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)


def decode_records(records: Iterable[Mapping[str, Any]]) -> tuple[list[tuple[int, Event]], list[str]]:
    """Recording lines (``infra/replay.py`` format) -> ``(ts_ms, event)`` pairs, and the rejects' reasons."""
    events: list[tuple[int, Event]] = []
    rejected: list[str] = []
    for rec in records:
        raw = rec.get("value")
        value = base64.b64decode(raw["b64"]) if isinstance(raw, dict) else None if raw is None else str(raw)
        topic = BY_NAME.get(str(rec.get("topic")))
        try:
            ev = decode(value.encode() if isinstance(value, str) else value, topic.event if topic else None)
        except DecodeError as exc:
            rejected.append(f"{rec.get('topic')}@{rec.get('offset')}: {exc}")
            continue
        ts: Any = rec.get("ts_ms") or getattr(ev, "ts_ms", 0)
        events.append((int(ts), ev))
    return events, rejected


class OfflinePipeline:
    """The worker's detection path in one object; feed it events in time order."""

    def __init__(self, config: ReplayConfig | None = None) -> None:
        self.config = config or ReplayConfig()
        self.inspector = NodeInspector(host=self.config.host)
        self.anomaly = NodeAnomalyScorer()
        self.monitors: dict[str, JobMonitor] = {}
        self.policy = DecisionPolicy(self.config.decide)
        self.captures = Captures(self.config.aggregation)
        self.specs: dict[str, JobSpec] = {}
        self.result = ReplayResult()
        self._now: int | None = None
        self._next_check = 0
        self._next_capture_tick = 0

    def feed(self, ts_ms: int, ev: Event) -> None:
        self.advance(ts_ms)
        now = self._now if self._now is not None else ts_ms
        if isinstance(ev, JobSpec):
            known = self.specs.get(ev.job)
            if known is None or known.ts_ms <= ev.ts_ms:
                self.specs[ev.job] = ev
        elif isinstance(ev, TrainingStep):
            self._emit(self._monitor(ev.job).on_step(ev, now), now)
        elif isinstance(ev, ProcessExit):
            self._emit(self._monitor(ev.job).on_exit(ev, now) if ev.job else [], now)
        elif isinstance(ev, StackDump):
            cap = next((c for c in self.captures.pending.values() if c.job == ev.job), None)
            if cap is not None:
                cap.add(ev)
        elif isinstance(ev, Decision):
            self._aggregate(ev, now)
        elif not isinstance(ev, Detection):
            self._emit(self.inspector.inspect(ev, now), now)
            if isinstance(ev, GpuSampleBatch):
                det = self.anomaly.observe(
                    ev, self.config.anomaly_detector, self.config.anomaly_threshold, now
                )
                self._emit([det] if det is not None else [], now)

    def remember(self, dec: Decision) -> None:
        """Start from the live worker's state: ``dec`` was decided before the recording began."""
        self.policy.remember(dec)
        if dec.action is Action.AGGREGATE:
            last = self.captures.last_capture_ms.get(dec.job, dec.ts_ms)
            self.captures.last_capture_ms[dec.job] = max(last, dec.ts_ms)

    def advance(self, now_ms: int) -> None:
        """Move the clock to ``now_ms``, firing the training check and capture timers on the way."""
        if self._now is None:
            self._now = now_ms
            self._next_check = self._next_tick(now_ms, int(self.config.check_interval_s * 1000))
            self._next_capture_tick = self._next_tick(now_ms, CAPTURE_TICK_MS)
        while min(self._next_check, self._next_capture_tick) <= now_ms:
            if self._next_check <= self._next_capture_tick:
                self._now = self._next_check
                self._next_check += int(self.config.check_interval_s * 1000)
                for job in list(self.monitors):
                    self._emit(self.monitors[job].check(self._now), self._now)
            else:
                self._now = self._next_capture_tick
                self._next_capture_tick += CAPTURE_TICK_MS
                self._close_captures(self._now)
        self._now = max(self._now, now_ms)

    def finish(self) -> ReplayResult:
        """Close the captures still open at their deadlines (the live worker would have), then the result.

        Only the capture timer runs past the last record: the recording ending is not a stall.
        """
        while self.captures.pending:
            deadline = min(c.deadline_ms for c in self.captures.pending.values())
            self._now = max(self._now or 0, self._next_tick(deadline - 1, CAPTURE_TICK_MS))
            self._close_captures(self._now)
        return self.result

    @staticmethod
    def _next_tick(now_ms: int, period_ms: int) -> int:
        return now_ms - now_ms % period_ms + period_ms

    def _monitor(self, job: str) -> JobMonitor:
        if job not in self.monitors:
            self.monitors[job] = JobMonitor(job, self.config.monitor)
        return self.monitors[job]

    def _topology(self, job: str) -> JobTopology | None:
        spec = self.specs.get(job)
        return spec.topology if spec is not None else None

    def _emit(self, dets: Iterable[Detection], now: int) -> None:
        for det in dets:
            self.result.detections.append(det)
            topology = self._topology(det.job) if det.action is Action.EVICT and not det.node else None
            dec = self.policy.decide(det, now, topology)
            if dec is not None:
                self.result.decisions.append(dec)
                self._aggregate(dec, now)

    def _aggregate(self, dec: Decision, now: int) -> None:
        if dec.action is not Action.AGGREGATE or not self.captures.wants(dec.job, now):
            return
        started = self.captures.start(dec, self._topology(dec.job), now)
        if isinstance(started, Detection):
            self._emit([started], now)

    def _close_captures(self, now: int) -> None:
        for cap in self.captures.due(now):
            try:
                det = cap.analyze(now)
            except Exception as exc:  # as in the agent: a bad capture is a diagnose detection
                det = cap.failed(str(exc), now)
            self._emit([det], now)


def replay_events(
    events: Iterable[tuple[int, Event]],
    config: ReplayConfig | None = None,
    prior: Iterable[Decision] = (),
) -> ReplayResult:
    """Run ``(ts_ms, event)`` pairs (time order) through the offline pipeline; detections and decisions.

    ``prior``: the worker's decisions from before the recording (de-duplication window and capture
    cooldown), so the replay continues where the live worker was rather than from a blank state.
    """
    pipeline = OfflinePipeline(config)
    for dec in prior:
        pipeline.remember(dec)
    for ts, ev in events:
        pipeline.feed(ts, ev)
    return pipeline.finish()
