"""Training agent: step telemetry, process exits and the nodes' rank liveness -> NaN/spike, exit,
stall, silent-machine, straggler and stopped-job detections.

Steps, exits and liveness are keyed by job, so a job's monitor lives on one worker.  A timer asks every
monitor of a job this worker currently owns for time-based findings (stall = hang suspicion,
stragglers, a stopped job), so a hang is noticed from missing progress, not from an NCCL timeout.
The action service's events are followed by every worker: a job is "stopped" only while no
recovery works on it and none is held.  Monitors of jobs whose partition moved to another worker
are dropped (that worker now watches the job).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from trainguard.detectors.routing import INPUTS, TRAINING, DetectionPath
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.codec import decode
from trainguard.schemas.control import ActionEvent
from trainguard.schemas.topics import ACTIONS, STEPS
from trainguard.schemas.workload import ProcessExit, RankLiveness, TrainingStep
from trainguard.streams.context import WorkerContext
from trainguard.streams.state import WorkerState

NAME = TRAINING
log = logging.getLogger(__name__)
#: how long the steps backlog waits for the broker's end offsets (asked once a second).
REFRESH_TIMEOUT_S = 2.0
#: how far back a starting worker reads the action service's events.
_ACTIONS_HISTORY_MS = 24 * 3600 * 1000


class Ownership:
    """Which jobs this worker owns (the steps partition each job's events come from)."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.partition: dict[str, int] = {}

    def owned(self, job: str) -> bool:
        try:
            assigned = {(tp.topic, tp.partition) for tp in self.ctx.app.consumer.assignment()}
        except Exception:  # consumer not started yet
            return True
        part = self.partition.get(job)
        return part is None or (self.ctx.topic_name(STEPS), part) in assigned


class StepsBacklog:
    """Whether step records wait unread on this worker's partitions: the partition's end is past
    the last offset processed.  The end is the larger of the consumer's high watermark (from its
    last fetch) and the broker's end offset (asked by :meth:`refresh`, once a second): the fetch's
    alone stops moving while the consumer is not fetching the partition, and a worker 30-70 s
    behind on steps took itself for caught up and judged every job hung (demo run
    ``20261128-052330``).  Unknown (nothing fetched or asked, nothing processed from a partition
    yet) counts as no backlog."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.processed: dict[int, int] = {}  # partition -> last offset processed
        self.broker_end: dict[int, int] = {}  # partition -> its end offset, as the broker said

    def seen(self, partition: int, offset: int) -> None:
        if offset > self.processed.get(partition, -1):
            self.processed[partition] = offset

    async def refresh(self) -> None:
        """Ask the broker for the end offsets of this worker's steps partitions."""
        topic = self.ctx.topic_name(STEPS)
        consumer = self.ctx.app.consumer
        parts = [tp for tp in consumer.assignment() if tp.topic == topic]
        # A partition that moved away and back starts afresh: an offset processed before it left
        # would say "behind" until its next record arrives.
        mine = {tp.partition for tp in parts}
        self.processed = {p: o for p, o in self.processed.items() if p in mine}
        if not parts:
            self.broker_end.clear()
            return
        # Bounded: with the broker away the request would wait for its whole timeout.
        ends = await asyncio.wait_for(consumer.highwaters(*parts), REFRESH_TIMEOUT_S)
        self.broker_end = {tp.partition: int(end) for tp, end in ends.items() if end is not None}

    def __call__(self) -> bool:
        topic = self.ctx.topic_name(STEPS)
        try:
            consumer = self.ctx.app.consumer
            for tp in consumer.assignment():
                done = self.processed.get(tp.partition) if tp.topic == topic else None
                if done is None:
                    continue
                high = max(consumer.highwater(tp) or -1, self.broker_end.get(tp.partition, -1))
                if high > done + 1:
                    return True
        except Exception:  # consumer not started or rebalancing: no backlog known
            return False
        return False


def register(ctx: WorkerContext, path: DetectionPath, state: WorkerState | None = None) -> None:
    ownership = Ownership(ctx)
    store = state.store(NAME) if state else None
    #: stall checks use the stream's time, so a lagging worker does not see every job stall; the
    #: aggregation judges hang captures by it too.
    backlog = StepsBacklog(ctx)
    clock = path.stream_clock
    clock.backlog = backlog

    async def body(ev: Event) -> None:
        now = now_ms()
        if isinstance(ev, TrainingStep | RankLiveness):
            clock.observe(ev.ts_ms, now)
        if state is not None and isinstance(ev, TrainingStep | ProcessExit | RankLiveness) and ev.job:
            state.touch(NAME, ev.job)  # a step or an exit moves the job's monitor on
        for det in path.findings(NAME, ev, now):
            await ctx.emit(det)
            ctx.metrics.detections.labels(NAME).inc()

    @ctx.app.agent(ctx.faust_topics(*INPUTS[NAME]), name=NAME)
    async def training(stream: Any) -> None:
        async for event in stream.events():
            if event.message.topic == ctx.topic_name(STEPS):
                backlog.seen(event.message.partition, event.message.offset)
                if isinstance(event.key, bytes):
                    ownership.partition[event.key.decode(errors="replace")] = event.message.partition
            await ctx.guard(event, NAME, body, store)

    def on_action(raw: bytes | None) -> None:
        # Every worker reads every action event: the stopped-job check must know which jobs a
        # recovery is working on, whichever worker owns the job's steps, and the decide stage
        # which incidents' recoveries ended, whichever worker owns the job's detections.
        # Garbage raises DecodeError, which the reader logs and passes.
        ev = decode(raw, expect=ActionEvent)
        if isinstance(ev, ActionEvent):
            path.on_action(ev)

    # The last day is enough: a recovery at work emits events every few seconds; one held for
    # longer than that is forgotten by a restarted worker (its job then looks stopped and gets a
    # restart decision, queued behind the held recovery).  From the start of a 30-day topic, a
    # worker's start would replay every recovery of the month.
    ctx.follow(ACTIONS, on_action, "actions", since_ms=lambda: now_ms() - _ACTIONS_HISTORY_MS)

    @ctx.app.timer(1.0)
    async def refresh_backlog() -> None:
        try:
            await backlog.refresh()
        except Exception as exc:  # consumer not started, rebalancing, broker away: fetch's only
            log.debug("steps end offsets not known: %r", exc)

    @ctx.app.timer(ctx.cfg.check_interval_s)
    async def check_jobs() -> None:
        now = now_ms()
        if store is not None:  # its reports are state too: not written before they are sent
            store.busy += 1
        try:
            for det in path.check(now, clock.now(now), keep=ownership.owned):
                if state is not None:  # one report per stall, also after a restart
                    state.touch(NAME, det.job)
                await ctx.emit(det)
                ctx.metrics.detections.labels(NAME).inc()
        finally:
            if store is not None:
                store.busy -= 1
