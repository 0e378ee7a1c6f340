"""Offline replay of a recorded incident through the stream worker's detection path: no Kafka, no Faust.

:func:`replay_events` feeds recorded events, in order, through a
:class:`~trainguard.detectors.routing.DetectionPath` -- the very object whose stages the worker's agents
(``streams/agents/``) call -- and routes every event, recorded or produced, to the stages that
consume its topic (:data:`~trainguard.detectors.routing.INPUTS`), as Kafka does for the agents:

* inspection, anomaly, training -- telemetry to detections; the training stage's time-based
  checks run every ``check_interval_s``;
* decide -- every detection; a node-less eviction is localised with the job's latest
  :class:`~trainguard.schemas.control.JobSpec` seen so far (the worker's job directory follows the same
  jobs topic);
* aggregation -- an ``aggregate`` decision (made here or recorded) opens a capture, captures are
  closed and analysed on the stage's 1 s tick.  The capture commands are not sent anywhere: the
  recorded stack dumps answer them.  They carry the capture id of the live run, so a job's dumps
  are filed under the job's pending capture (there is one capture per job at a time).

State from before the recording that shapes what happens in it -- the decisions already made,
whose incidents merge repeats, and the last capture's time (cooldown) -- is passed in as ``prior``
decisions.  Differences from the live worker, on purpose: the clock is the records' own
timestamps (the Kafka record time, when the event reached the broker), not the wall clock, so
the worker's processing lag is not replayed; timers fire at every multiple of their interval
between two records and stop at the last record (except the capture timer, which runs on to
close open captures); an emitted detection reaches the decide stage, and a decision the
aggregation stage, at once instead of through Kafka.  Recorded detections are ignored (this
pipeline makes its own); commands, actions and heartbeats are not inputs of any stage.
Garbage records are returned as rejects, as the agents skip them (the sink dead-letters them).
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from trainguard.detectors.capture import AggregationConfig
from trainguard.detectors.decide import DecideConfig
from trainguard.detectors.job_monitor import MonitorConfig
from trainguard.detectors.node_inspector import HostThresholds
from trainguard.detectors.registry import check_params
from trainguard.detectors.routing import (
    AGGREGATION,
    CAPTURE_TICK_S,
    DECIDE,
    JOB_SPECS,
    DetectionPath,
    newer_spec,
    stages_for,
)
from trainguard.schemas.base import Event
from trainguard.schemas.codec import DecodeError, decode
from trainguard.schemas.config import load_config
from trainguard.schemas.control import ActionEvent, Decision, Detection, JobSpec
from trainguard.schemas.topics import BY_NAME
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.typecheck import bounds
from trainguard.schemas.workload import FlightRecorderDump, StackDump

#: the aggregation stage's timer period (it closes due captures).
CAPTURE_TICK_MS = int(CAPTURE_TICK_S * 1000)


@dataclass(frozen=True)
class ReplayConfig:
    """The detector settings of a worker config (same names as its ``worker`` section)."""

    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    decide: DecideConfig = field(default_factory=DecideConfig)
    host: HostThresholds = field(default_factory=HostThresholds)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    check_interval_s: float = field(default=2.0, metadata=bounds(0.1, 600))
    anomaly_detector: str = "ewma_zscore"
    anomaly_threshold: float = field(default=8.0, metadata=bounds(0, 1e9))
    anomaly_params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.anomaly_detector:
            check_params(self.anomaly_detector, self.anomaly_params)

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
        self.path = DetectionPath(self.config)
        self.specs: dict[str, JobSpec] = {}
        self.result = ReplayResult()
        self._now: int | None = None
        self._next_check = 0
        self._next_capture_tick = 0

    def feed(self, ts_ms: int, ev: Event) -> None:
        self.advance(ts_ms)
        if isinstance(ev, Detection):
            return  # recorded detections: this pipeline makes its own
        if isinstance(ev, ActionEvent):  # what the action service did: the stopped-job context
            self.path.on_action(ev)
            return
        self._publish(ev, self._now if self._now is not None else ts_ms)

    def remember(self, dec: Decision) -> None:
        """Start from the live worker's state: ``dec`` was decided before the recording began."""
        self.path.remember(dec)

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
                for det in self.path.check(self._now):
                    self._publish(det, self._now)
            else:
                self._now = self._next_capture_tick
                self._next_capture_tick += CAPTURE_TICK_MS
                self._close_captures(self._now)
        self._now = max(self._now, now_ms)

    def finish(self) -> ReplayResult:
        """Close the captures still open at their deadlines (the live worker would have), then the result.

        Only the capture timer runs past the last record: the recording ending is not a stall.
        """
        while self.path.captures.pending:
            deadline = min(c.deadline_ms for c in self.path.captures.pending.values())
            self._now = max(self._now or 0, self._next_tick(deadline - 1, CAPTURE_TICK_MS))
            self._close_captures(self._now)
        return self.result

    @staticmethod
    def _next_tick(now_ms: int, period_ms: int) -> int:
        return now_ms - now_ms % period_ms + period_ms

    def _topology(self, job: str) -> JobTopology | None:
        spec = self.specs.get(job)
        return spec.topology if spec is not None else None

    def _publish(self, ev: Event, now: int) -> None:
        """``ev`` on its topic: every stage that consumes the topic gets it, at once."""
        for stage in stages_for(ev):
            self._run(stage, ev, now)

    def _run(self, stage: str, ev: Event, now: int) -> None:
        """What the agent of ``stage`` does with ``ev``, with an in-memory topic between stages."""
        path = self.path
        if stage == DECIDE and isinstance(ev, Detection):
            self.result.detections.append(ev)
            dec = path.decide(ev, now, self._topology(ev.job))
            if dec is not None:
                self.result.decisions.append(dec)
                self._publish(dec, now)
        elif stage == AGGREGATION and isinstance(ev, StackDump):
            path.add_dump(ev, by_job=True)
        elif stage == AGGREGATION and isinstance(ev, FlightRecorderDump):
            path.add_fr_dump(ev, by_job=True)
        elif stage == AGGREGATION and isinstance(ev, Decision):
            if path.wants_capture(ev, now):
                for out in path.start_capture(ev, self._topology(ev.job), now):
                    self._publish(out, now)  # commands go nowhere: the recorded dumps answer them
        elif stage == JOB_SPECS and isinstance(ev, JobSpec):
            if newer_spec(ev, self.specs.get(ev.job)):
                self.specs[ev.job] = ev
        elif stage not in (DECIDE, AGGREGATION, JOB_SPECS):
            for det in path.findings(stage, ev, now):
                self._publish(det, now)

    def _close_captures(self, now: int) -> None:
        for cap in self.path.due_captures(now):
            det = self.path.moot_capture(cap, now) or self.path.analyze(cap, now)
            more = self.path.extend_capture(cap, det, now)
            if more:  # a close fail-slow vote: the recording's later rounds (if any) answer them
                for cmd in more:
                    self._publish(cmd, now)
                continue
            self._publish(det, now)


def replay_events(
    events: Iterable[tuple[int, Event]],
    config: ReplayConfig | None = None,
    prior: Iterable[Decision] = (),
) -> ReplayResult:
    """Run ``(ts_ms, event)`` pairs (time order) through the offline pipeline; detections and decisions.

    ``prior``: the worker's decisions from before the recording (their open incidents and the capture
    cooldown), so the replay continues where the live worker was rather than from a blank state.
    """
    events = list(events)
    config = config or ReplayConfig()
    if config.aggregation.flight_recorder and not any(isinstance(ev, FlightRecorderDump) for _, ev in events):
        # A recording without Flight Recorder answers (made before the exporters gave them, or of
        # a job without a recorder): its captures complete on the stacks, as they did live.
        config = replace(config, aggregation=replace(config.aggregation, flight_recorder=False))
    pipeline = OfflinePipeline(config)
    for dec in prior:
        pipeline.remember(dec)
    for ts, ev in events:
        pipeline.feed(ts, ev)
    return pipeline.finish()
