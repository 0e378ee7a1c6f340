"""Inspection agent: GPU, NIC, host samples and log lines -> detections (rule table, windows),
and the anomaly stage on the GPU samples.

Node telemetry is keyed by node, so one node's samples always reach the same worker and the
rule windows ("2 NIC alerts in 5 minutes", repeated Xid 13/31/43) see every occurrence.

The anomaly stage (:class:`trainguard.detectors.node_anomaly.NodeAnomalyScorer`, one streaming detector per
node; scores above the threshold become ``info`` detections, evidence for operators and the
aggregation analysis, never an eviction on their own) reads the same GPU samples.  It runs here,
on the event this agent decoded, rather than as an agent of its own: a second agent on the GPU
topic received and decoded every GPU batch a second time (the largest input, by far).
"""

from __future__ import annotations

import logging
from typing import Any

from trainguard.detectors.routing import ANOMALY, INPUTS, INSPECTION, DetectionPath
from trainguard.schemas.base import Event, now_ms
from trainguard.streams.context import WorkerContext
from trainguard.streams.state import WorkerState

NAME = INSPECTION
#: the events the anomaly stage scores (its inputs are a subset of this agent's).
_ANOMALY_INPUTS = tuple(t.event for t in INPUTS[ANOMALY])
assert {t.name for t in INPUTS[ANOMALY]} <= {t.name for t in INPUTS[INSPECTION]}

log = logging.getLogger(__name__)


def register(ctx: WorkerContext, path: DetectionPath, state: WorkerState | None = None) -> None:
    store = state.store(NAME) if state else None

    async def body(ev: Event) -> None:
        now = now_ms()
        for det in path.findings(NAME, ev, now):
            await ctx.emit(det)
            ctx.metrics.detections.labels(NAME).inc()
        if isinstance(ev, _ANOMALY_INPUTS):
            await score(ev, now)

    async def score(ev: Event, now: int) -> None:
        # Informational only: a scorer failure is logged and counted, never a reason to
        # dead-letter a sample the rule table has already handled.
        try:
            found = list(path.findings(ANOMALY, ev, now))
        except Exception:
            log.exception("anomaly stage failed on a %s sample (the rules did run on it)", ev.TYPE)
            ctx.metrics.stage_errors.labels(ANOMALY).inc()
            return
        for det in found:
            await ctx.emit(det)
            ctx.metrics.detections.labels(ANOMALY).inc()

    @ctx.app.agent(ctx.faust_topics(*INPUTS[NAME]), name=NAME)
    async def inspection(stream: Any) -> None:
        async for event in stream.events():
            await ctx.guard(event, NAME, body, store)
