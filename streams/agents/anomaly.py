"""Anomaly agent: per-node multivariate GPU metrics -> anomaly score -> informational detections.

Thin wiring of :class:`detectors.node_anomaly.NodeAnomalyScorer` (one streaming detector per
node, registry name and threshold from the worker config, both changeable at runtime): scores
above the threshold become ``info`` detections with action ``none``, evidence for operators and
for the aggregation analysis, never an eviction on their own.
"""

from __future__ import annotations

from typing import Any

from detectors.node_anomaly import NodeAnomalyScorer
from schemas.base import Event, now_ms
from schemas.telemetry import GpuSampleBatch
from schemas.topics import GPU
from streams.context import WorkerContext

NAME = "anomaly"


def register(ctx: WorkerContext) -> NodeAnomalyScorer:
    scorer = NodeAnomalyScorer()

    async def body(ev: Event) -> None:
        if not isinstance(ev, GpuSampleBatch):
            return
        det = scorer.observe(ev, ctx.cfg.anomaly_detector, ctx.cfg.anomaly_threshold, now_ms())
        if det is not None:
            await ctx.emit(det)
            ctx.metrics.detections.labels(NAME).inc()

    @ctx.app.agent(ctx.faust_topic(GPU), name=NAME)
    async def anomaly(stream: Any) -> None:
        async for event in stream.events():
            await ctx.guard(event, NAME, body)

    return scorer
