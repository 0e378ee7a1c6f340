"""Inspection agent: GPU, NIC, host samples and log lines -> detections (rule table, windows).

Node telemetry is keyed by node, so one node's samples always reach the same worker and the
rule windows ("2 NIC alerts in 5 minutes", repeated Xid 13/31/43) see every occurrence.
"""

from __future__ import annotations

from typing import Any

from detectors.routing import INPUTS, INSPECTION, DetectionPath
from schemas.base import Event, now_ms
from streams.context import WorkerContext
from streams.state import WorkerState

NAME = INSPECTION


def register(ctx: WorkerContext, path: DetectionPath, state: WorkerState | None = None) -> None:
    store = state.store(NAME) if state else None

    async def body(ev: Event) -> None:
        for det in path.findings(NAME, ev, now_ms()):
            await ctx.emit(det)
            ctx.metrics.detections.labels(NAME).inc()

    @ctx.app.agent(ctx.faust_topics(*INPUTS[NAME]), name=NAME)
    async def inspection(stream: Any) -> None:
        async for event in stream.events():
            await ctx.guard(event, NAME, body, store)
