"""A small torch autoencoder over a node's metric vector; score = reconstruction error.

Metrics of a healthy node move together (power follows SM utilisation, temperature follows
power).  An autoencoder with a narrow bottleneck learns that joint structure from a sliding window
and flags samples it cannot reconstruct, such as high power at idle utilisation, even when every
metric alone is in range.  Training is a few Adam steps every ``refit_every`` samples (warm-started
from the previous weights), single-threaded on CPU with a fixed seed; scoring is a numpy forward
pass over a copy of the weights, so it costs microseconds and no torch call.  torch is imported
on the first fit only, so ``import detectors`` stays light.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainguard.detectors.base import AnomalyDetector, clean_sample, finite_score
from trainguard.schemas.typecheck import bounds

Z_CLIP = 1e6
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


@dataclass(frozen=True)
class AutoencoderParams:
    """Parameters of :class:`Autoencoder`."""

    window_size: int = field(default=512, metadata=bounds(8, 1_000_000))
    """Number of most recent learned samples the network is trained on."""
    refit_every: int = field(default=128, metadata=bounds(1, 1_000_000))
    """Train again after this many learned samples."""
    warmup: int = field(default=64, metadata=bounds(2, 1_000_000))
    """First training once this many samples were learned; scores are 0 before."""
    hidden: int = field(default=16, metadata=bounds(1, 4096))
    """Width of the encoder and decoder hidden layers."""
    code: int = field(default=2, metadata=bounds(1, 4096))
    """Width of the bottleneck; keep it below the number of features or it learns the identity."""
    steps: int = field(default=40, metadata=bounds(1, 100_000))
    """Adam steps per training round."""
    batch_size: int = field(default=64, metadata=bounds(1, 100_000))
    lr: float = field(default=0.01, metadata=bounds(1e-6, 10.0))
    min_std: float = field(default=1e-6, metadata=bounds(1e-12, None))
    """Absolute floor of the per-feature standard deviation used to standardise."""
    rel_min_std: float = field(default=0.01, metadata=bounds(0.0, None))
    """Floor of the standard deviation relative to ``|mean|`` (constant metrics)."""
    seed: int = field(default=0, metadata=bounds(0, 2**31 - 1))


def _init_layers(sizes: list[int], gen: np.random.Generator) -> list[np.ndarray]:
    """Weights and biases drawn like ``torch.nn.Linear`` (uniform +-1/sqrt(fan_in)), from ``gen``."""
    params = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        bound = 1.0 / math.sqrt(fan_in)
        params.append(gen.uniform(-bound, bound, (fan_in, fan_out)))
        params.append(gen.uniform(-bound, bound, fan_out))
    return params


def forward(params: list[np.ndarray], z: np.ndarray) -> np.ndarray:
    """Reconstruction of standardised rows ``z``: tanh hidden layers, linear code and output."""
    w1, b1, w2, b2, w3, b3, w4, b4 = params
    code = np.tanh(z @ w1 + b1) @ w2 + b2
    return np.tanh(code @ w3 + b3) @ w4 + b4


class Autoencoder(AnomalyDetector):
    """Reconstruction error (RMS, in window standard deviations) of a windowed autoencoder.

    Features are the sorted union of keys in the window at training time, standardised with the
    window's mean and standard deviation (refreshed at every round).  Missing values are imputed
    with the mean; the score averages the squared error over the features *present* in the
    scored sample only, so an absent metric is never the reason for a high score.  Features first
    seen after a round are ignored until the next one; a changed feature set re-initialises the
    network.

    Parameters
    ----------
    window_size, refit_every, warmup, hidden, code, steps, batch_size, lr, min_std, rel_min_std, seed
        See :class:`AutoencoderParams`.

    Examples
    --------
    >>> d = Autoencoder(window_size=256, refit_every=128, steps=60, seed=1)
    >>> for i in range(256):  # warm-up: power tracks utilisation, temperature tracks power
    ...     util = 50 + 40 * math.sin(i / 7)
    ...     d.learn_one({"util": util, "power_w": 100 + 3 * util, "temp_c": 40 + 0.2 * util})
    >>> round(d.score_one({"util": 70.0, "power_w": 310.0, "temp_c": 54.0}), 2)
    0.03
    >>> round(d.score_one({"util": 5.0, "power_w": 400.0, "temp_c": 54.0}), 1)  # power, no work
    1.4

    References
    ----------
    Sakurada, M., & Yairi, T. (2014). Anomaly detection using autoencoders with nonlinear
    dimensionality reduction. *MLSDA Workshop*.
    """

    Params = AutoencoderParams

    def reset(self) -> None:
        self._window: deque[dict[str, float]] = deque(maxlen=self.params.window_size)
        self._since_fit = 0
        self._fits = 0
        self._features: list[str] = []
        self._mean = np.zeros(0)
        self._std = np.ones(0)
        self._weights: list[np.ndarray] = []

    def _fit(self) -> None:
        features = sorted({k for x in self._window for k in x})
        if not features:
            return
        p = self.params
        X = np.array([[x.get(f, np.nan) for f in features] for x in self._window])
        mean = np.nanmean(X, axis=0)
        std = np.maximum(np.nanstd(X, axis=0), np.maximum(p.min_std, p.rel_min_std * np.abs(mean)))
        Z = np.nan_to_num((X - mean) / std, nan=0.0)  # missing -> the mean
        gen = np.random.default_rng([p.seed, self._fits])
        weights = self._weights
        if features != self._features or not weights:
            weights = _init_layers([len(features), p.hidden, p.code, p.hidden, len(features)], gen)
        self._weights = _train(weights, Z, gen, p)
        self._features, self._mean, self._std = features, mean, std
        self._fits += 1

    def learn_one(self, x: Mapping[str, float]) -> None:
        sample = clean_sample(x)
        if not sample:
            return
        self._window.append(sample)
        self._since_fit += 1
        due = self._since_fit >= self.params.refit_every
        if (not self._weights and len(self._window) >= self.params.warmup) or due:
            self._fit()
            self._since_fit = 0

    def score_one(self, x: Mapping[str, float]) -> float:
        sample = clean_sample(x)
        present = np.array([f in sample for f in self._features], dtype=bool)
        if not self._weights or not present.any():
            return 0.0
        values = np.array([sample.get(f, m) for f, m in zip(self._features, self._mean, strict=True)])
        # Beyond a million standard deviations the exact distance no longer matters; clipping keeps
        # the squared error finite for absurd readings.
        z = np.clip((values - self._mean) / self._std, -Z_CLIP, Z_CLIP)
        err = (forward(self._weights, z[None, :])[0] - z)[present]
        return finite_score(math.sqrt(float(np.mean(err * err))))

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {"window_size": 128, "refit_every": 64, "warmup": 32, "hidden": 8, "steps": 30, "seed": 5}


def import_torch() -> Any:
    """Import torch on demand (seconds of start-up that ``import detectors`` must not pay)."""
    import warnings

    with warnings.catch_warnings():
        # torch's CUDA probe warns about the deprecated pynvml package; irrelevant on CPU.
        warnings.simplefilter("ignore", FutureWarning)
        import torch
    return torch


def _train(weights: list[np.ndarray], Z: np.ndarray, gen: np.random.Generator, p: Any) -> list[np.ndarray]:
    """Run ``p.steps`` Adam steps on mini-batches of ``Z``; return the new weights as numpy.

    Adam is written out (Kingma & Ba, 2015, Algorithm 1, default betas) rather than taken from
    ``torch.optim``: constructing a ``torch.optim`` optimizer imports ~900 modules (dynamo,
    sympy, distributed), seconds of start-up a stream worker should not pay for eight tensors.
    """
    torch = import_torch()
    threads = torch.get_num_threads()
    # One thread: the stream worker shares the machine, and tiny matmuls gain nothing from more.
    torch.set_num_threads(1)
    try:
        params = [torch.tensor(w, dtype=torch.float32, requires_grad=True) for w in weights]
        first = [torch.zeros_like(t) for t in params]
        second = [torch.zeros_like(t) for t in params]
        data = torch.tensor(Z, dtype=torch.float32)
        batch = min(p.batch_size, len(Z))
        for step in range(1, p.steps + 1):
            # Batches come from the seeded numpy generator, so torch's global RNG is never used.
            zb = data[torch.from_numpy(gen.choice(len(Z), size=batch, replace=False))]
            w1, b1, w2, b2, w3, b3, w4, b4 = params
            code = torch.tanh(zb @ w1 + b1) @ w2 + b2
            recon = torch.tanh(code @ w3 + b3) @ w4 + b4
            torch.mean((recon - zb) ** 2).backward()
            with torch.no_grad():
                for t, m, v in zip(params, first, second, strict=True):
                    g = t.grad
                    m.mul_(ADAM_BETAS[0]).add_(g, alpha=1 - ADAM_BETAS[0])
                    v.mul_(ADAM_BETAS[1]).addcmul_(g, g, value=1 - ADAM_BETAS[1])
                    m_hat = m / (1 - ADAM_BETAS[0] ** step)
                    v_hat = v / (1 - ADAM_BETAS[1] ** step)
                    t.sub_(p.lr * m_hat / (v_hat.sqrt() + ADAM_EPS))
                    t.grad = None
        return [t.detach().numpy().astype(np.float64) for t in params]
    finally:
        torch.set_num_threads(threads)
