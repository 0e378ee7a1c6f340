"""Threshold and quantile filters: deciding on scores, and protecting the baseline from anomalies."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detectors.anomaly import EWMAZScore
from detectors.filters import QuantileFilter, ThresholdFilter
from schemas.config import ConfigError


def warm(f: ThresholdFilter | QuantileFilter, n: int = 100) -> None:
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
    assert open_.score_one({"temp": 90.0}) < protected.score_one({"temp": 90.0})


def test_relearn_after_adopts_a_persistent_shift() -> None:
    stuck = ThresholdFilter(EWMAZScore(alpha=0.05), threshold=5.0)
    adapts = ThresholdFilter(EWMAZScore(alpha=0.05), threshold=5.0, relearn_after=10)
    for f in (stuck, adapts):
        warm(f)
        flags = [f.process_one({"temp": 80.0 + (i % 3)})[1] for i in range(300)]
    assert all(flags[:10])
    assert stuck.process_one({"temp": 81.0})[1]  # never learned the new level: flags forever
    assert not adapts.process_one({"temp": 81.0})[1]


def test_learn_one_is_process_one() -> None:
    a, b = ThresholdFilter(EWMAZScore(), threshold=4.0), ThresholdFilter(EWMAZScore(), threshold=4.0)
    xs = [{"temp": 60 + (i % 5) * 0.5} for i in range(50)] + [{"temp": 99.0}, {"temp": 61.0}]
    for x in xs:
        a.learn_one(x)
        b.process_one(x)
    assert a.detector._stats == b.detector._stats  # type: ignore[attr-defined]


def test_quantile_filter_waits_for_min_scores_then_tracks_quantile() -> None:
    f = QuantileFilter(EWMAZScore(), q=0.9, window=50, min_scores=20)
    assert f.threshold == float("inf")
    assert not f.process_one({"temp": 1e9})[1]  # nothing flagged during warm-up
    warm(f, 200)
    assert f.threshold == pytest.approx(np.quantile(list(f._recent), 0.9, method="higher"))
    assert len(f._recent) == 50


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    scores=st.lists(st.floats(0, 1e6), min_size=1, max_size=80),
    q=st.floats(0, 1),
    window=st.integers(1, 30),
)
def test_quantile_threshold_equals_numpy_higher_quantile(scores: list[float], q: float, window: int) -> None:
    f = QuantileFilter(EWMAZScore(), q=q, window=window, min_scores=1)
    for s in scores:
        f._observe(s)
    expected = np.quantile(scores[-window:], q, method="higher")
    assert f.threshold == expected
    assert f._sorted == sorted(scores[-window:])


def test_reset_clears_detector_and_scores() -> None:
    f = QuantileFilter(EWMAZScore(), q=0.99, min_scores=5)
    warm(f)
    f.reset()
    assert f.threshold == float("inf")
    assert f.score_one({"temp": 99.0}) == 0.0


@pytest.mark.parametrize(
    ("cls", "params"),
    [
        (ThresholdFilter, {}),
        (ThresholdFilter, {"threshold": float("nan")}),
        (ThresholdFilter, {"threshold": 1.0, "relearn_after": -1}),
        (QuantileFilter, {"q": 1.5}),
        (QuantileFilter, {"q": 0.9, "window": 0}),
        (QuantileFilter, {"q": 0.9, "treshold": 3}),
    ],
)
def test_filters_reject_bad_params(cls: type[ThresholdFilter] | type[QuantileFilter], params: dict) -> None:
    with pytest.raises(ConfigError):
        cls(EWMAZScore(), **params)
