"""Isolation Forest over a sliding window of recent samples, refitted every N samples.

Multivariate and assumption-free: it flags samples that are easy to isolate from the last
``window_size`` samples (a node whose power/temperature/throughput *combination* is unusual even
if each metric alone is in range).  Fitting is scikit-learn's; scoring walks flattened copies
of the trees in numpy, because ``IsolationForest.score_samples`` costs milliseconds of overhead
per call, which a per-event stream cannot afford.  Refits are amortised over ``refit_every``
events.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainguard.detectors.base import AnomalyDetector, clean_sample, finite_score
from trainguard.schemas.typecheck import bounds

F32_MAX = float(np.finfo(np.float32).max)


def average_path_length(n: np.ndarray) -> np.ndarray:
    """Expected path length ``c(n)`` of an unsuccessful BST search among ``n`` points.

    This is the depth correction the Isolation Forest paper adds at leaves that still hold
    ``n`` training points (same formula as scikit-learn's private helper).

    >>> average_path_length(np.array([1, 2, 256])).round(3)
    array([ 0.   ,  1.   , 10.245])
    """
    n = np.asarray(n, dtype=float)
    out = np.zeros_like(n)
    out[n == 2] = 1.0
    big = n > 2
    out[big] = 2.0 * (np.log(n[big] - 1.0) + np.euler_gamma) - 2.0 * (n[big] - 1.0) / n[big]
    return out


class FlatForest:
    """A fitted ``IsolationForest`` as padded numpy arrays, scored one sample at a time.

    Leaves point to themselves, so a fixed number of vectorised steps (the trees' depth limit)
    walks every tree to its leaf without per-tree branching.  Scores equal
    ``-forest.score_samples(X)``.
    """

    def __init__(self, forest: Any) -> None:
        trees = [est.tree_ for est in forest.estimators_]
        width = max(t.node_count for t in trees)
        shape = (len(trees), width)
        self.left = np.zeros(shape, dtype=np.intp)
        self.right = np.zeros(shape, dtype=np.intp)
        self.feature = np.zeros(shape, dtype=np.intp)
        self.threshold = np.zeros(shape)
        self.leaf_depth = np.zeros(shape)
        self.depth = 1
        for i, (tree, features) in enumerate(zip(trees, forest.estimators_features_, strict=True)):
            n = tree.node_count
            nodes = np.arange(n)
            is_leaf = tree.children_left[:n] == -1
            self.left[i, :n] = np.where(is_leaf, nodes, tree.children_left[:n])
            self.right[i, :n] = np.where(is_leaf, nodes, tree.children_right[:n])
            # Trees index a per-tree feature subset; map back to the full vector's columns.
            self.feature[i, :n] = np.where(is_leaf, 0, np.asarray(features)[np.maximum(tree.feature[:n], 0)])
            self.threshold[i, :n] = tree.threshold[:n]
            depth = np.zeros(n)
            for node in range(n):  # children always have larger ids than their parent
                if not is_leaf[node]:
                    depth[tree.children_left[node]] = depth[tree.children_right[node]] = depth[node] + 1
            self.leaf_depth[i, :n] = depth + average_path_length(tree.n_node_samples[:n])
            self.depth = max(self.depth, int(depth.max()))
        self.rows = np.arange(len(trees))
        self.norm = len(trees) * float(average_path_length(np.array([forest.max_samples_]))[0])

    def score(self, x: np.ndarray) -> float:
        """``-score_samples`` of one feature vector (in (0, 1], ~0.5 is ordinary)."""
        # scikit-learn trees compare float32 inputs against float64 thresholds; clip first so an
        # absurd reading lands on the extreme branch instead of overflowing to inf.
        x = np.clip(x, -F32_MAX, F32_MAX).astype(np.float32).astype(np.float64)
        node = np.zeros(len(self.rows), dtype=np.intp)
        for _ in range(self.depth):
            go_left = x[self.feature[self.rows, node]] <= self.threshold[self.rows, node]
            node = np.where(go_left, self.left[self.rows, node], self.right[self.rows, node])
        total = float(self.leaf_depth[self.rows, node].sum())
        return 2.0 ** (-total / self.norm) if self.norm > 0 else 1.0


@dataclass(frozen=True)
class WindowedIsolationForestParams:
    """Parameters of :class:`WindowedIsolationForest`."""

    window_size: int = field(default=256, metadata=bounds(8, 1_000_000))
    """Number of most recent learned samples the forest is fitted on."""
    refit_every: int = field(default=128, metadata=bounds(1, 1_000_000))
    """Refit after this many learned samples (the amortisation period)."""
    warmup: int = field(default=32, metadata=bounds(2, 1_000_000))
    """First fit once this many samples were learned; scores are 0 before."""
    n_estimators: int = field(default=50, metadata=bounds(1, 10_000))
    max_samples: int = field(default=128, metadata=bounds(2, 1_000_000))
    """Subsample size per tree (capped by the window length)."""
    seed: int = field(default=0, metadata=bounds(0, 2**31 - 1))


class WindowedIsolationForest(AnomalyDetector):
    """Isolation Forest refitted on a sliding window; score = ``-score_samples`` in (0, 1].

    The feature set is the union of the keys in the window at fit time (sorted).  Missing or
    non-finite values, in the window and in scored samples, are replaced by the window median of
    that feature, so a missing metric neither raises nor looks anomalous.  Features first seen
    after a fit are ignored until the next refit.

    Parameters
    ----------
    window_size, refit_every, warmup, n_estimators, max_samples, seed
        See :class:`WindowedIsolationForestParams`.

    Examples
    --------
    >>> d = WindowedIsolationForest(window_size=128, refit_every=64, seed=7)
    >>> for i in range(256):  # warm-up on a steady GPU
    ...     d.learn_one({"temp_c": 60 + (i % 5) * 0.5, "power_w": 300 + (i % 7) * 3.0})
    >>> round(d.score_one({"temp_c": 61.0, "power_w": 306.0}), 2)
    0.51
    >>> round(d.score_one({"temp_c": 85.0, "power_w": 120.0}), 2)
    0.64

    References
    ----------
    Liu, F. T., Ting, K. M., & Zhou, Z.-H. (2008). Isolation Forest. *ICDM*.
    """

    Params = WindowedIsolationForestParams

    def reset(self) -> None:
        self._window: deque[dict[str, float]] = deque(maxlen=self.params.window_size)
        self._since_fit = 0
        self._fits = 0
        self._forest: FlatForest | None = None
        self._features: list[str] = []
        self._fill = np.zeros(0)

    def _vector(self, x: dict[str, float]) -> np.ndarray:
        return np.array([x.get(f, fill) for f, fill in zip(self._features, self._fill, strict=True)])

    def _fit(self) -> None:
        from sklearn.ensemble import IsolationForest  # heavy import, paid on first fit only

        features = sorted({k for x in self._window for k in x})
        if not features:
            return
        X = np.array([[x.get(f, np.nan) for f in features] for x in self._window])
        fill = np.nanmedian(X, axis=0)  # every column has at least one value: it came from a key
        X = np.where(np.isnan(X), fill, X)
        p = self.params
        forest = IsolationForest(
            n_estimators=p.n_estimators,
            max_samples=min(p.max_samples, len(X)),
            # A new, reproducible seed per refit: the same stream always gives the same forests.
            random_state=(p.seed + 7919 * self._fits) % 2**31,
        ).fit(X)
        self._forest, self._features, self._fill = FlatForest(forest), features, fill
        self._fits += 1

    def learn_one(self, x: Mapping[str, float]) -> None:
        sample = clean_sample(x)
        if not sample:
            return
        self._window.append(sample)
        self._since_fit += 1
        due = self._since_fit >= self.params.refit_every
        if (self._forest is None and len(self._window) >= self.params.warmup) or due:
            self._fit()
            self._since_fit = 0

    def score_one(self, x: Mapping[str, float]) -> float:
        if self._forest is None:
            return 0.0
        return finite_score(self._forest.score(self._vector(clean_sample(x))))

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {"window_size": 128, "refit_every": 64, "warmup": 32, "n_estimators": 25, "seed": 3}
