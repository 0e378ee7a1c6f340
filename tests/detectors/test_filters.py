"""The threshold filter: deciding on scores, and protecting the baseline from anomalies."""

from __future__ import annotations

import pytest

from detectors.anomaly import EWMAZScore
from detectors.filters import ThresholdFilter
from detectors.node_anomaly import NodeAnomalyScorer
from schemas.config import ConfigError
from schemas.telemetry import GpuSample, GpuSampleBatch


def warm(f: ThresholdFilter, n: int = 100) -> None:
    for i in range(n):
        f.process_one({"temp": 60 + (i % 5) * 0.5})


def test_threshold_classifies_at_and_above() -> None:
    f = ThresholdFilter(EWMAZScore(), threshold=3.0)
    assert f.classify(3.0)
    assert f.classify(10.0)
    assert not f.classify(2.99)


def test_protection_keeps_anomalies_out_of_the_baseline() -> None:
    protected = ThresholdFilter(EWMAZScore(), threshold=5.0)
    open_ = ThresholdFilter(EWMAZScore(), threshold=5.0, protect_anomaly_detector=False)
    for f in (protected, open_):
        warm(f)
    stats_before = list(protected.detector._stats["temp"])  # type: ignore[attr-defined]
    for _ in range(5):
        _, flagged = protected.process_one({"temp": 90.0})
        assert flagged
        open_.process_one({"temp": 90.0})
    assert protected.detector._stats["temp"] == stats_before  # type: ignore[attr-defined]
    # The unprotected baseline drifted towards the fault and now scores it lower.
    assert open_.detector.score_one({"temp": 90.0}) < protected.detector.score_one({"temp": 90.0})


def test_relearn_after_adopts_a_persistent_shift() -> None:
    stuck = ThresholdFilter(EWMAZScore(alpha=0.05), threshold=5.0)
    adapts = ThresholdFilter(EWMAZScore(alpha=0.05), threshold=5.0, relearn_after=10)
    for f in (stuck, adapts):
        warm(f)
        flags = [f.process_one({"temp": 80.0 + (i % 3)})[1] for i in range(300)]
    assert all(flags[:10])
    assert stuck.process_one({"temp": 81.0})[1]  # never learned the new level: flags forever
    assert not adapts.process_one({"temp": 81.0})[1]


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"threshold": float("nan")},
        {"threshold": 1.0, "relearn_after": -1},
        {"threshold": 1.0, "treshold": 3},
    ],
)
def test_filter_rejects_bad_params(params: dict) -> None:
    with pytest.raises(ConfigError):
        ThresholdFilter(EWMAZScore(), **params)


def _batch(ts_ms: int, temp: float) -> GpuSampleBatch:
    return GpuSampleBatch(node="n0", ts_ms=ts_ms, gpus=[GpuSample(index=0, temperature_c=temp)])


def test_node_scorer_flags_at_its_threshold_and_keeps_the_baseline_when_it_changes() -> None:
    scorer = NodeAnomalyScorer()
    for i in range(100):
        assert scorer.observe(_batch(i, 60 + (i % 5) * 0.5), "ewma_zscore", 6.0, i) is None
    learned = scorer.filters["n0"].detector
    det = scorer.observe(_batch(100, 90.0), "ewma_zscore", 6.0, 100)
    assert det is not None and det.evidence["detector"] == "ewma_zscore"
    # A higher threshold (the worker config changed) applies at once, to the same learned detector.
    assert scorer.observe(_batch(101, 90.0), "ewma_zscore", 1e6, 101) is None
    assert scorer.filters["n0"].detector is learned and scorer.filters["n0"].params.threshold == 1e6
