"""Per-node multivariate GPU anomaly scores -> informational detections (the anomaly agent's logic).

Each node gets its own streaming detector (a registry name) fed a small feature vector per GPU
sample batch (mean/max temperature, mean power, mean utilisation, memory use).  Scores at or
above the threshold become ``info`` detections with action ``none``: evidence for operators and
for the aggregation analysis, never an eviction on their own.  A sample that scores as an
anomaly is not learned, so the detector is protected from learning its own anomalies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainguard.detectors.detections import detection_from_finding
from trainguard.detectors.filters import ThresholdFilter
from trainguard.detectors.findings import Finding
from trainguard.detectors.registry import build
from trainguard.schemas.control import Detection
from trainguard.schemas.enums import Action, Severity
from trainguard.schemas.telemetry import GpuSampleBatch, GpuState


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


class NodeAnomalyScorer:
    """One streaming detector per node behind a :class:`~trainguard.detectors.filters.ThresholdFilter`;
    ``detector``, its ``params`` and ``threshold`` may change between calls (a runtime switch):
    a new threshold keeps what the node's detector learned, another detector or other
    parameters start a new one -- what one algorithm learned means nothing to another."""

    def __init__(self) -> None:
        self.filters: dict[str, ThresholdFilter] = {}
        #: node -> (detector name, params) its filter was built with.
        self.built: dict[str, tuple[str, dict[str, Any]]] = {}

    def observe(
        self,
        e: GpuSampleBatch,
        detector: str,
        threshold: float,
        now_ms: int,
        params: Mapping[str, Any] | None = None,
    ) -> Detection | None:
        if not detector:
            return None
        x = gpu_features(e)
        if not x:
            return None
        recipe = (detector, dict(params or {}))  # compared by value on every sample: no encoding
        f = self.filters.get(e.node)
        if f is None or self.built.get(e.node) != recipe:
            f = self.filters[e.node] = ThresholdFilter(build(detector, params or {}), threshold=threshold)
            self.built[e.node] = recipe
        elif f.params.threshold != threshold:  # a new threshold keeps what the detector learned
            f = self.filters[e.node] = ThresholdFilter(f.detector, threshold=threshold)
        score, flagged = f.process_one(x)  # anomalies never enter the baseline
        if not flagged:
            return None
        finding = Finding(
            kind="metric_anomaly",
            category="metric_anomaly",
            severity=Severity.INFO,
            action=Action.NONE,
            node=e.node,
            score=score,
            evidence={"features": x, "detector": detector},
        )
        return detection_from_finding(
            finding, job=e.job, node=e.node, source_ts_ms=e.ts_ms, now_ms=now_ms, source_key="anomaly"
        )
