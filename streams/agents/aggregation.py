"""Aggregation agent (ByteRobust §5): on a hang or fail-slow suspicion, capture every rank's
stacks and find the parallel group to evict.

``aggregate`` decisions and stack dumps are both keyed by job (and co-partitioned), so one
worker sees a job's request and every answer.  A request becomes one ``capture_stacks`` command
per machine of the job (one round for a hang, ``fail_slow_rounds`` rounds ``fail_slow_interval_s``
apart for fail-slow); a timer closes captures that are complete or past their deadline and runs
the over-eviction classifier in a thread, off the event loop.  The result is a detection (kind
``over_eviction``) that the decide agent turns into an eviction of the group.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from detectors.capture import Captures
from schemas.base import Event, now_ms
from schemas.control import Decision, Detection
from schemas.enums import Action
from schemas.topics import COMMANDS, DECISIONS, STACKS
from schemas.workload import StackDump
from streams.context import WorkerContext
from streams.jobs import JobDirectory

NAME = "aggregation"
log = logging.getLogger(__name__)


def register(ctx: WorkerContext, jobs: JobDirectory) -> Captures:
    captures = Captures(ctx.cfg.aggregation)

    async def start_capture(dec: Decision) -> None:
        captures.config = ctx.cfg.aggregation  # runtime threshold changes
        now = now_ms()
        if not captures.wants(dec.job, now):
            return
        spec = await jobs.spec(dec.job)
        started = captures.start(dec, spec.topology if spec is not None else None, now)
        if isinstance(started, Detection):
            await ctx.emit(started)
            return
        for cmd in captures.commands(started):
            await ctx.emit(cmd, COMMANDS)
        log.info(
            "capture %s requested from %d machines of %s",
            started.capture_id,
            len(started.topology.machines),
            dec.job,
        )

    async def body(ev: Event) -> None:
        if isinstance(ev, Decision) and ev.action is Action.AGGREGATE:
            await start_capture(ev)
        elif isinstance(ev, StackDump):
            captures.add(ev)

    @ctx.app.agent(ctx.faust_topics(DECISIONS, STACKS), name=NAME)
    async def aggregation(stream: Any) -> None:
        async for event in stream.events():
            await ctx.guard(event, NAME, body)

    @ctx.app.timer(1.0)
    async def close_captures() -> None:
        now = now_ms()
        for cap in captures.due(now):
            try:
                det = await asyncio.get_running_loop().run_in_executor(None, cap.analyze, now)
            except Exception as exc:  # a bad capture must not stop the agent
                log.exception("over-eviction analysis of %s failed", cap.capture_id)
                det = cap.failed(str(exc), now)
            await ctx.emit(det)
            ctx.metrics.detections.labels(NAME).inc()

    return captures
