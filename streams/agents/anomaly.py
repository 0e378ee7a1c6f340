"""Anomaly agent: per-node multivariate GPU metrics -> anomaly score -> informational detections.

Thin wiring of the path's anomaly stage (:class:`detectors.node_anomaly.NodeAnomalyScorer`, one
streaming detector per node, registry name and threshold from the worker config, both changeable
at runtime): scores above the threshold become ``info`` detections with action ``none``,
evidence for operators and for the aggregation analysis, never an eviction on their own.
"""

from __future__ import annotations

from typing import Any

from detectors.routing import ANOMALY, INPUTS, DetectionPath
from schemas.base import Event, now_ms
from streams.context import WorkerContext

NAME = ANOMALY


def register(ctx: WorkerContext, path: DetectionPath) -> None:
    async def body(ev: Event) -> None:
        for det in path.findings(NAME, ev, now_ms()):
            await ctx.emit(det)
            ctx.metrics.detections.labels(NAME).inc()

    @ctx.app.agent(ctx.faust_topics(*INPUTS[NAME]), name=NAME)
    async def anomaly(stream: Any) -> None:
        async for event in stream.events():
            await ctx.guard(event, NAME, body)
