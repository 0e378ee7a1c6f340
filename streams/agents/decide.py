"""Decide agent: detections -> decisions (deterministic ids, one per incident).

A repeat of a fault is merged into its incident while the incident's recovery is at work; the
policy learns that a recovery ended from the action events the training agent follows on every
worker (:meth:`trainguard.detectors.routing.DetectionPath.on_action`), on this same event loop.
"""

from __future__ import annotations

from typing import Any

from trainguard.detectors.routing import DECIDE, INPUTS, DetectionPath, needs_topology
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.control import Detection
from trainguard.streams.context import WorkerContext
from trainguard.streams.jobs import JobDirectory
from trainguard.streams.state import WorkerState

NAME = DECIDE


def register(
    ctx: WorkerContext, path: DetectionPath, jobs: JobDirectory, state: WorkerState | None = None
) -> None:
    store = state.store(NAME) if state else None

    async def body(ev: Event) -> None:
        if not isinstance(ev, Detection):
            return
        topology = await jobs.topology(ev.job) if needs_topology(ev) else None
        decision = path.decide(ev, now_ms(), topology)
        if decision is not None:
            await ctx.emit(decision)
            ctx.metrics.decisions.labels(decision.action.value).inc()

    @ctx.app.agent(ctx.faust_topics(*INPUTS[NAME]), name=NAME)
    async def decide(stream: Any) -> None:
        async for event in stream.events():
            await ctx.guard(event, NAME, body, store)
