"""The robust (median/MAD) z-score detector on synthetic series (#41): it keeps scoring a regime
change the EWMA absorbs, ignores one spike in its baseline, and its bench comparison code."""

from __future__ import annotations

import numpy as np
import pytest

from bench.nab_eval import compare, evaluate_series, stream_scores
from trainguard.detectors.anomaly import EWMAZScore, RobustZScore
from trainguard.detectors.registry import build
from trainguard.schemas.config import ConfigError


def noisy(n: int, seed: int = 0, level: float = 50.0, sd: float = 2.0) -> np.ndarray:
    return level + np.random.default_rng(seed).normal(0, sd, n)


def feed(detector: RobustZScore | EWMAZScore, values: np.ndarray) -> list[float]:
    """Score-then-learn over one feature; the scores."""
    out = []
    for v in values:
        x = {"v": float(v)}
        out.append(detector.score_one(x))
        detector.learn_one(x)
    return out


def test_exact_median_and_mad_when_refreshed_every_sample() -> None:
    values = noisy(100)
    d = RobustZScore(window=50, refresh_every=1, warmup=8, smooth=1, rel_min_scale=0.0)
    feed(d, values)
    tail = values[-50:]
    med = np.median(tail)
    mad = 1.4826 * np.median(np.abs(tail - med))
    assert d.score_one({"v": 70.0}) == pytest.approx(abs(70.0 - med) / mad)


def test_sustained_shift_keeps_scoring_after_the_ewma_absorbed_it() -> None:
    values = np.concatenate([noisy(1500), noisy(300, seed=1, level=65.0)])  # +7.5 sd for 300 samples
    robust = np.array(feed(RobustZScore(window=1000), values))
    ewma = np.array(feed(EWMAZScore(), values))
    # 200 samples into the shift: the EWMA (memory ~50 samples) scores it as normal again; the
    # median and MAD of the last 1000 values, a fifth of them shifted, have barely moved, so the
    # robust score stays well above anything the noise reaches.
    late = slice(1700, 1800)
    assert np.median(ewma[late]) < 2.0
    assert np.min(robust[late]) > 3.0
    assert np.max(robust[1100:1500]) < 2.0


def test_one_spike_moves_neither_the_baseline_nor_the_score_for_long() -> None:
    d = RobustZScore(window=500, refresh_every=1, smooth=4)
    feed(d, noisy(500))
    before = d.score_one({"v": 50.0})
    spike = d.score_one({"v": 1e6})
    assert spike >= d.params.clip_z / 4  # capped, then averaged with 3 normal samples
    d.learn_one({"v": 1e6})
    feed(d, noisy(3, seed=2))  # the spike leaves the smoothing window
    assert d.score_one({"v": 50.0}) == pytest.approx(before, abs=0.5)


def test_smoothing_ranks_a_sustained_departure_above_a_lone_spike_of_the_same_size() -> None:
    base = noisy(600)
    d_lone, d_held = RobustZScore(smooth=8), RobustZScore(smooth=8)
    feed(d_lone, base)
    feed(d_held, base)
    for _ in range(7):  # the held one has been at +10 sd for 7 samples already
        d_held.learn_one({"v": 70.0})
    assert d_held.score_one({"v": 70.0}) > 3 * d_lone.score_one({"v": 70.0})


def test_warmup_scores_zero_and_constant_series_use_the_relative_floor() -> None:
    d = RobustZScore(warmup=10)
    for _ in range(9):
        d.learn_one({"v": 100.0})
    assert d.score_one({"v": 1000.0}) == 0.0
    d.learn_one({"v": 100.0})
    # MAD 0: the scale is 1% of the median, so a 1% wiggle is z = 1 (smoothed with 0 history).
    assert d.score_one({"v": 101.0}) == pytest.approx(1.0 / 1)


@pytest.mark.parametrize("params", [{"window": 4}, {"smooth": 0}, {"clip_z": 0.5}, {"warmup": 1}])
def test_rejects_bad_params(params: dict[str, int | float]) -> None:
    with pytest.raises(ConfigError):
        build("robust_zscore", params)


def test_bench_point_f1_prefers_the_detector_that_holds_a_level_shift() -> None:
    values = list(noisy(3000, seed=3))
    values[2000:2400] = list(noisy(400, seed=4, level=62.0))  # a labelled 400-sample incident
    windows = [(2000, 2399)]
    results: dict = {"detectors": {}}
    for name in ("ewma_zscore", "robust_zscore"):
        counts, _, _ = evaluate_series(stream_scores(build(name), values), windows)
        results["detectors"][name] = {"files": {"synthetic": counts.summary()}}
    comp = compare(results, "ewma_zscore")
    assert comp["wins"]["robust_zscore"]["wins"] == 1
    assert comp["winner"]["synthetic"] == "robust_zscore"
    point = comp["point_f1"]["synthetic"]
    assert point["robust_zscore"] > 0.5 > point["ewma_zscore"]
