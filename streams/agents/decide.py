"""Decide agent: detections -> decisions (deterministic ids, de-duplicated within a window)."""

from __future__ import annotations

from typing import Any

from detectors.decide import DecisionPolicy
from schemas.base import Event, now_ms
from schemas.control import Detection
from schemas.topics import DETECTIONS
from streams.context import WorkerContext
from streams.jobs import JobDirectory

NAME = "decide"


def register(ctx: WorkerContext, jobs: JobDirectory) -> DecisionPolicy:
    policy = DecisionPolicy(ctx.cfg.decide)

    async def body(ev: Event) -> None:
        if not isinstance(ev, Detection):
            return
        topology = await jobs.topology(ev.job) if ev.action.value == "evict" and not ev.node else None
        decision = policy.decide(ev, now_ms(), topology)
        if decision is not None:
            await ctx.emit(decision)
            ctx.metrics.decisions.labels(decision.action.value).inc()

    @ctx.app.agent(ctx.faust_topic(DETECTIONS), name=NAME)
    async def decide(stream: Any) -> None:
        async for event in stream.events():
            await ctx.guard(event, NAME, body)

    return policy
