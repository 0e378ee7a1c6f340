"""The threshold filter: deciding on scores, and protecting the baseline from anomalies."""

from __future__ import annotations

import pytest

from trainguard.detectors.anomaly import EWMAZScore
from trainguard.detectors.filters import ThresholdFilter
from trainguard.detectors.node_anomaly import NodeAnomalyScorer
from trainguard.schemas.config import ConfigError
from trainguard.schemas.telemetry import GpuSample, GpuSampleBatch


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


def test_switching_the_detector_at_runtime_takes_effect_and_the_evidence_names_it() -> None:
    """The worker config's detector changes (``set-threshold anomaly_detector ...``): each node
    starts the new one -- before, a node kept the detector it started with while the evidence
    named the new one."""
    scorer = NodeAnomalyScorer()
    for i in range(60):
        scorer.observe(_batch(i, 60 + (i % 5) * 0.5), "ewma_zscore", 6.0, i)
    assert type(scorer.filters["n0"].detector).__name__ == "EWMAZScore"
    for i in range(60, 200):
        det = scorer.observe(_batch(i, 60 + (i % 5) * 0.5), "isolation_forest", 0.9, i, {"window_size": 64})
        assert det is None or det.evidence["detector"] == "isolation_forest"
    f = scorer.filters["n0"]
    assert type(f.detector).__name__ == "WindowedIsolationForest"
    assert f.detector.params.window_size == 64  # parameters from the config, not the defaults
    # New parameters for the same detector: a new detector too.
    scorer.observe(_batch(200, 60.0), "isolation_forest", 0.9, 200, {"window_size": 32})
    assert scorer.filters["n0"] is not f and scorer.filters["n0"].detector.params.window_size == 32


@pytest.mark.parametrize(
    ("detector", "params"),
    [("ewma_zscore", {"window_size": 64}), ("isolation_forest", {"alpha": 0.1}), ("no-such-detector", {})],
)
def test_worker_config_refuses_anomaly_params_its_detector_does_not_take(detector: str, params: dict) -> None:
    from trainguard.schemas.config import load_config
    from trainguard.streams.config import WorkerConfig

    with pytest.raises(ConfigError):
        load_config(WorkerConfig, {"anomaly_detector": detector, "anomaly_params": params})
    ok = load_config(
        WorkerConfig, {"anomaly_detector": "isolation_forest", "anomaly_params": {"window_size": 64}}
    )
    assert ok.anomaly_params == {"window_size": 64}
