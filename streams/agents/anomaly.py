"""Anomaly agent: per-node multivariate GPU metrics -> anomaly score -> informational detections.

Each node gets its own streaming detector (registry name from the worker config) fed a small
feature vector per sample batch (mean/max temperature, mean power, mean utilisation, memory
use).  Scores above the threshold become ``info`` detections with action ``none``: evidence for
operators and for the aggregation analysis, never an eviction on their own.  Scoring is cheap
(a few floats per node per 10 s); the detector is protected from learning its own anomalies.
"""

from __future__ import annotations

from typing import Any

from detectors.base import AnomalyDetector
from detectors.detections import detection_from_finding
from detectors.findings import Finding
from detectors.registry import build
from schemas.base import Event, now_ms
from schemas.enums import Action, Severity
from schemas.telemetry import GpuSampleBatch, GpuState
from schemas.topics import GPU
from streams.context import WorkerContext

NAME = "anomaly"


def gpu_features(e: GpuSampleBatch) -> dict[str, float]:
    ok = [g for g in e.gpus if g.state is GpuState.OK]

    def vals(attr: str) -> list[float]:
        return [float(v) for g in ok if (v := getattr(g, attr)) is not None]

    out: dict[str, float] = {}
    for attr, name in (("temperature_c", "temp"), ("power_w", "power"), ("util_gpu_pct", "util")):
        v = vals(attr)
        if v:
            out[f"{name}_mean"] = sum(v) / len(v)
            out[f"{name}_max"] = max(v)
    used = [
        g.mem_used_bytes / g.mem_total_bytes for g in ok if g.mem_used_bytes is not None and g.mem_total_bytes
    ]
    if used:
        out["mem_frac_mean"] = sum(used) / len(used)
    return out


def register(ctx: WorkerContext) -> dict[str, AnomalyDetector]:
    detectors: dict[str, AnomalyDetector] = {}

    async def body(ev: Event) -> None:
        if not isinstance(ev, GpuSampleBatch) or not ctx.cfg.anomaly_detector:
            return
        x = gpu_features(ev)
        if not x:
            return
        det = detectors.get(ev.node)
        if det is None:
            det = detectors[ev.node] = build(ctx.cfg.anomaly_detector, {})
        score = det.score_one(x)
        if score >= ctx.cfg.anomaly_threshold:
            finding = Finding(
                kind="metric_anomaly",
                category="metric_anomaly",
                severity=Severity.INFO,
                action=Action.NONE,
                node=ev.node,
                score=score,
                evidence={"features": x, "detector": ctx.cfg.anomaly_detector},
            )
            await ctx.emit(
                detection_from_finding(
                    finding,
                    job=ev.job,
                    node=ev.node,
                    source_ts_ms=ev.ts_ms,
                    now_ms=now_ms(),
                    source_key="anomaly",
                )
            )
            ctx.metrics.detections.labels(NAME).inc()
        else:
            det.learn_one(x)  # anomalies never enter the baseline

    @ctx.app.agent(ctx.faust_topic(GPU), name=NAME)
    async def anomaly(stream: Any) -> None:
        async for event in stream.events():
            await ctx.guard(event, NAME, body)

    return detectors
