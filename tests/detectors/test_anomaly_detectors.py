"""Detector-specific behaviour, the registry, and the NAB bench's metric code (synthetic data)."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from sklearn.ensemble import IsolationForest

from trainguard.detectors.anomaly import Autoencoder, EWMAZScore, WindowedIsolationForest
from trainguard.detectors.anomaly.autoencoder import (
    AutoencoderParams,
    _init_layers,
    _train,
    forward,
    import_torch,
)
from trainguard.detectors.anomaly.iforest import FlatForest
from trainguard.detectors.registry import build, get, register, registered
from trainguard.schemas.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def gpu(i: int) -> dict[str, float]:
    return {"temp_c": 60 + (i % 5) * 0.5, "power_w": 300 + (i % 7) * 3.0}


# --- EWMA z-score -------------------------------------------------------------------------------


def test_ewma_matches_exact_mean_and_variance_during_start_up() -> None:
    xs = [3.0, 5.0, 4.0, 10.0, 7.0]
    d = EWMAZScore(alpha=0.01, warmup=100)  # 1/n weights for the first 100 samples
    for v in xs:
        d.learn_one({"v": v})
    count, mean, var = d._stats["v"]
    assert count == 5
    assert mean == pytest.approx(np.mean(xs))
    assert var == pytest.approx(np.var(xs))


def test_ewma_constant_series_uses_floors() -> None:
    d = EWMAZScore()
    for _ in range(50):
        d.learn_one({"temp": 65.0, "xid_count": 0.0})
    assert d.score_one({"temp": 65.0, "xid_count": 0.0}) == 0.0
    # 1 % relative floor: 65 -> 66 C is ~1.5 sigma, not a division by zero.
    assert d.score_features({"temp": 66.0})["temp"] == pytest.approx(1 / 0.65)
    # A counter stuck at 0 that moves is hugely anomalous, but finite.
    assert d.score_one({"xid_count": 1.0}) == pytest.approx(1e6)


def test_ewma_winsorising_keeps_second_spike_visible() -> None:
    robust, naive = EWMAZScore(alpha=0.05), EWMAZScore(alpha=0.05, clip_z=1e6)
    for i in range(200):
        robust.learn_one(gpu(i))
        naive.learn_one(gpu(i))
    spike = {"temp_c": 90.0}
    for d in (robust, naive):
        d.learn_one(spike)
    assert robust.score_one(spike) > 3 * naive.score_one(spike)


def test_ewma_absorbs_level_shift() -> None:
    d = EWMAZScore(alpha=0.05)
    for i in range(200):
        d.learn_one({"v": 10.0 + (i % 3)})
    first = d.score_one({"v": 50.0 + 1})
    for i in range(300):
        d.learn_one({"v": 50.0 + (i % 3)})
    assert first > 10
    assert d.score_one({"v": 51.0}) < 3


def test_ewma_skips_values_that_would_overflow() -> None:
    d = EWMAZScore(warmup=2)
    for v in (1.0, 2.0, 1e300, 1.5):
        d.learn_one({"v": v})
    assert math.isfinite(d._stats["v"][2])
    assert d.score_one({"v": 1.5}) < 5


@pytest.mark.parametrize(
    "params", [{"alpha": 0.0}, {"alpha": 1.5}, {"warmup": 0}, {"clip_z": 0.5}, {"alpha": float("nan")}]
)
def test_ewma_rejects_bad_params(params: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        EWMAZScore(**params)


# --- Isolation Forest ---------------------------------------------------------------------------


def test_flat_forest_equals_sklearn_score_samples() -> None:
    rs = np.random.RandomState(0)
    X = rs.randn(200, 4)
    X[:, 3] = 1.0  # a constant column
    # max_features < 1 makes each tree use a feature subset: exercises the index mapping.
    forest = IsolationForest(n_estimators=30, max_samples=64, max_features=0.5, random_state=1).fit(X)
    Y = np.vstack([rs.randn(100, 4) * 3, X[:10]])
    flat = FlatForest(forest)
    np.testing.assert_allclose([flat.score(y) for y in Y], -forest.score_samples(Y), rtol=0, atol=1e-12)


def test_iforest_refits_on_schedule_with_bounded_window() -> None:
    d = WindowedIsolationForest(window_size=64, refit_every=50, warmup=20, n_estimators=5)
    assert d.score_one(gpu(0)) == 0.0  # nothing fitted yet
    for i in range(170):
        d.learn_one(gpu(i))
    # First fit at 20 samples, then every 50 more: 70, 120, 170.
    assert d._fits == 4
    assert len(d._window) == 64
    assert d.score_one(gpu(3)) > 0


def test_iforest_imputes_missing_features_with_window_median() -> None:
    d = WindowedIsolationForest(window_size=64, refit_every=64, warmup=64, n_estimators=10)
    for i in range(64):
        d.learn_one(gpu(i))
    median_power = float(np.median([gpu(i)["power_w"] for i in range(64)]))
    assert d.score_one({"temp_c": 61.0}) == d.score_one({"temp_c": 61.0, "power_w": median_power})


def test_iforest_cannot_split_a_constant_window() -> None:
    # Known limitation, pinned down: with zero spread there is no split, so every point gets the
    # same score.  The EWMA detector (enabled by default alongside) covers constant metrics.
    d = WindowedIsolationForest(window_size=64, refit_every=64, warmup=64, n_estimators=10)
    for _ in range(64):
        d.learn_one({"temp_c": 65.0})
    assert d.score_one({"temp_c": 95.0}) == d.score_one({"temp_c": 65.0})


def test_iforest_rejects_bad_params() -> None:
    with pytest.raises(ConfigError, match="window_size"):
        WindowedIsolationForest(window_size=2)
    with pytest.raises(ConfigError, match="n_estimators"):
        WindowedIsolationForest(n_estimators=0)


# --- Autoencoder --------------------------------------------------------------------------------


def correlated(i: int) -> dict[str, float]:
    util = 50 + 40 * math.sin(i / 7)
    return {"util": util, "power_w": 100 + 3 * util, "temp_c": 40 + 0.2 * util}


def test_autoencoder_numpy_forward_matches_torch() -> None:
    torch = import_torch()

    d = Autoencoder(window_size=64, refit_every=64, warmup=64, hidden=4, steps=5)
    for i in range(64):
        d.learn_one(correlated(i))
    z = np.random.RandomState(0).randn(5, 3)
    w = [torch.tensor(a) for a in d._weights]
    code = torch.tanh(torch.tensor(z) @ w[0] + w[1]) @ w[2] + w[3]
    expected = (torch.tanh(code @ w[4] + w[5]) @ w[6] + w[7]).numpy()
    np.testing.assert_allclose(forward(d._weights, z), expected, rtol=1e-10)


def test_autoencoder_hand_written_adam_matches_torch_optim() -> None:
    torch = import_torch()
    params = AutoencoderParams(steps=15, batch_size=16, lr=0.02)
    weights = _init_layers([3, 4, 2, 4, 3], np.random.default_rng(0))
    Z = np.random.RandomState(1).randn(40, 3)
    ours = _train(weights, Z, np.random.default_rng(2), params)

    gen = np.random.default_rng(2)  # same batches as above
    ref = [torch.tensor(w, dtype=torch.float32, requires_grad=True) for w in weights]
    opt = torch.optim.Adam(ref, lr=params.lr)
    data = torch.tensor(Z, dtype=torch.float32)
    for _ in range(params.steps):
        zb = data[torch.from_numpy(gen.choice(len(Z), size=16, replace=False))]
        code = torch.tanh(zb @ ref[0] + ref[1]) @ ref[2] + ref[3]
        loss = torch.mean((torch.tanh(code @ ref[4] + ref[5]) @ ref[6] + ref[7] - zb) ** 2)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, b.detach().numpy(), rtol=1e-4, atol=1e-6)


def test_autoencoder_flags_broken_correlation_and_ignores_missing() -> None:
    d = Autoencoder(window_size=256, refit_every=128, warmup=128, steps=60, seed=1)
    for i in range(256):
        d.learn_one(correlated(i))
    normal = d.score_one(correlated(300))
    assert d.score_one({"util": 5.0, "power_w": 400.0, "temp_c": 54.0}) > 10 * normal
    # Only the present feature is scored; an absent metric is never the cause of a high score.
    assert d.score_one({"util": correlated(300)["util"]}) < 1.0


def test_autoencoder_restores_torch_threads_and_reinitialises_on_new_features() -> None:
    torch = import_torch()

    before = torch.get_num_threads()
    d = Autoencoder(window_size=32, refit_every=16, warmup=16, steps=3)
    for i in range(16):
        d.learn_one(correlated(i))
    assert torch.get_num_threads() == before
    assert d._features == ["power_w", "temp_c", "util"]
    for i in range(16):
        d.learn_one({**correlated(i), "nic_gbps": 20.0})
    assert d._features == ["nic_gbps", "power_w", "temp_c", "util"]
    assert d._weights[0].shape == (4, d.params.hidden)


def test_importing_detectors_does_not_import_torch_or_sklearn() -> None:
    code = (
        "import trainguard.detectors.registry, sys; print('torch' in sys.modules, 'sklearn' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# --- Registry -----------------------------------------------------------------------------------


def test_registry_builds_by_name_with_validated_params() -> None:
    assert sorted(registered()) == ["autoencoder", "ewma_zscore", "isolation_forest", "robust_zscore"]
    assert build("isolation_forest", {"refit_every": 7}).params.refit_every == 7
    assert isinstance(build("autoencoder", {"seed": 3}), Autoencoder)
    assert get("ewma_zscore") is EWMAZScore


@pytest.mark.parametrize(
    ("name", "params", "match"),
    [
        ("nope", {}, "unknown detector 'nope'"),
        ("ewma_zscore", {"alpah": 0.1}, "unknown field"),
        ("ewma_zscore", {"alpha": 2.0}, "alpha"),
    ],
)
def test_registry_rejects_bad_names_and_params(name: str, params: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build(name, params)


def test_register_refuses_to_shadow_a_name() -> None:
    register("ewma_zscore", EWMAZScore)  # same class again: no-op
    with pytest.raises(ValueError, match="already registered"):
        register("ewma_zscore", Autoencoder)


# --- NAB bench metric code (no /work/shared needed) ---------------------------------------------


@pytest.fixture(scope="module")
def nab_eval() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nab_eval", ROOT / "bench" / "nab_eval.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["nab_eval"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_bench_counts_points_and_windows(nab_eval: ModuleType) -> None:
    flags = np.zeros(1000, dtype=bool)
    flags[[10, 620, 621, 700, 999]] = True  # 10 is in probation; 999 is a false positive
    c = nab_eval.evaluate_flags(flags, [(100, 160), (600, 650), (800, 850)], start=150)
    # Window (100, 160) is clipped to (150, 160); only (600, 650) is hit.
    assert (c.points, c.in_window) == (850, 11 + 51 + 51)
    assert (c.flagged, c.true_pos, c.windows, c.detected) == (4, 2, 3, 1)
    assert c.precision == pytest.approx(0.5)
    assert c.recall == pytest.approx(1 / 3)
    assert c.f1 == pytest.approx(0.4)
    total = c + c
    assert (total.flagged, total.detected, total.f1) == (8, 2, pytest.approx(0.4))


def test_bench_window_indices_are_inclusive(nab_eval: ModuleType) -> None:
    t0 = datetime(2014, 2, 14, 14, 30)
    ts = [t0 + timedelta(minutes=5 * i) for i in range(100)]
    windows = [
        ["2014-02-14 15:00:00.000000", "2014-02-14 15:10:00.000000"],  # samples 6..8
        ["2014-02-14 15:01:00", "2014-02-14 15:04:00"],  # between samples: empty, dropped
    ]
    assert nab_eval.window_indices(ts, windows) == [(6, 8)]


def test_bench_end_to_end_on_synthetic_series(nab_eval: ModuleType) -> None:
    rs = np.random.RandomState(0)
    values = list(10 + rs.randn(2000) * 0.5)
    values[1500] += 20  # a spike inside the first window; the second window holds nothing
    windows = [(1480, 1520), (1800, 1850)]
    scores = nab_eval.stream_scores(EWMAZScore(), values)
    counts, threshold, auc = nab_eval.evaluate_series(scores, windows, q=0.99)
    assert threshold == pytest.approx(np.quantile(scores[150:300], 0.99))
    assert counts.detected == 1
    assert counts.windows == 2
    assert scores[1500] > threshold
    assert 0.0 < counts.precision < 1.0  # 1 % of normal points exceed a 0.99 quantile
    assert auc is not None
    assert 0.0 <= auc <= 1.0
