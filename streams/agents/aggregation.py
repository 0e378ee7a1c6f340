"""Aggregation agent (ByteRobust §5): on a hang or fail-slow suspicion, capture every rank's
stacks (and, for a hang, its PyTorch Flight Recorder) and find the parallel group to evict.

``aggregate`` decisions, stack dumps and Flight Recorder dumps are all keyed by job (and
co-partitioned), so one worker sees a job's request and every answer.  A request becomes one
``capture_stacks`` command per machine of the job (one round for a hang, ``fail_slow_rounds``
rounds ``fail_slow_interval_s`` apart for fail-slow); a capture is closed as soon as its last
answer arrives (a timer closes the ones past their deadline) and the over-eviction classifier
runs in a thread, off the event loop.
A fail-slow vote too close to call re-opens the capture for more rounds (new commands) instead.
The result is a detection (kind ``over_eviction``) that the decide agent turns into an eviction of
the group.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from trainguard.detectors.routing import AGGREGATION, CAPTURE_TICK_S, INPUTS, DetectionPath
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.control import Command, Decision
from trainguard.schemas.workload import FlightRecorderDump, StackDump
from trainguard.streams.context import WorkerContext
from trainguard.streams.jobs import JobDirectory
from trainguard.streams.state import WorkerState

NAME = AGGREGATION
log = logging.getLogger(__name__)


def register(
    ctx: WorkerContext, path: DetectionPath, jobs: JobDirectory, state: WorkerState | None = None
) -> None:
    store = state.store(NAME) if state else None

    def touch(job: str) -> None:
        if state is not None:
            state.touch(NAME, job)

    async def start_capture(dec: Decision, deferred: bool = False) -> None:
        now = now_ms()
        if not deferred and not path.wants_capture(dec, now):
            return
        spec = await jobs.spec(dec.job)
        out = path.start_capture(dec, spec.topology if spec is not None else None, now)
        touch(dec.job)
        for ev in out:
            await ctx.emit(ev)
        commands = [c for c in out if isinstance(c, Command)]
        if commands:
            log.info(
                "capture %s requested from %d machines of %s%s",
                commands[0].args.get("capture_id"),
                len(commands),
                dec.job,
                " (refused a capture earlier)" if deferred else "",
            )

    async def body(ev: Event) -> None:
        if isinstance(ev, Decision):
            await start_capture(ev)
        elif isinstance(ev, StackDump | FlightRecorderDump):
            filed = path.add_dump(ev) if isinstance(ev, StackDump) else path.add_fr_dump(ev)
            if not filed:
                return  # a late answer, another worker's capture, or PyTorch's own timeout dump
            touch(ev.job)
            if path.capture_complete(ev):  # the last answer: judge now, not at the next tick
                wait_ms = path.capture_wait_ms(ev.capture_id, now_ms())
                if wait_ms <= 0:
                    await close_captures_now()
                else:  # a hang suspicion's capture: judged when the stall becomes a hang
                    task = asyncio.ensure_future(close_later(wait_ms / 1000))
                    later.add(task)
                    task.add_done_callback(_finished)

    #: the scheduled judgements (kept referenced until they ran).
    later: set[asyncio.Future[None]] = set()

    def _finished(task: asyncio.Future[None]) -> None:
        later.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("judging a capture failed: %r", task.exception())

    async def close_later(delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await close_captures_now()

    @ctx.app.agent(ctx.faust_topics(*INPUTS[NAME]), name=NAME)
    async def aggregation(stream: Any) -> None:
        async for event in stream.events():
            await ctx.guard(event, NAME, body, store)

    @ctx.app.timer(CAPTURE_TICK_S)
    async def close_captures() -> None:
        await close_captures_now()

    async def close_captures_now() -> None:
        # A closed capture is gone from the state: not written before its verdict is sent.
        if store is not None:
            store.busy += 1
        try:
            await _close_captures()
        finally:
            if store is not None:
                store.busy -= 1

    async def _close_captures() -> None:
        now = now_ms()
        for dec in path.deferred_captures(now):
            await start_capture(dec, deferred=True)
        for cap in path.due_captures(now, path.stream_clock.now(now)):
            touch(cap.job)
            # A hang the job has stepped past is judged here, not analysed (no eviction).
            moot = path.moot_capture(cap, now)
            det = (
                moot
                if moot is not None
                else await asyncio.get_running_loop().run_in_executor(None, path.analyze, cap, now)
            )
            more = path.extend_capture(cap, det, now_ms())
            if more:  # a close fail-slow vote: more rounds decide it
                log.info(
                    "capture %s: %s; rounds %d-%d asked from %d machines",
                    cap.capture_id, det.message, cap.extended_from, cap.rounds - 1, len(more),
                )  # fmt: skip
                for cmd in more:
                    await ctx.emit(cmd)
                continue
            if det.kind == "aggregation_failed":
                log.error("over-eviction analysis of %s failed: %s", cap.capture_id, det.evidence["error"])
            await ctx.emit(det)
            ctx.metrics.detections.labels(NAME).inc()
