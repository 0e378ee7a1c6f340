"""Per-feature EWMA z-score: the cheapest baseline, one mean and one variance per metric.

It catches a metric leaving its recent operating range (a GPU suddenly 20 degrees hotter, NIC
throughput collapsing) in O(features) time and memory, and it is the detector the other ones have
to beat.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainguard.detectors.base import AnomalyDetector, clean_sample, finite_score
from trainguard.schemas.typecheck import bounds


@dataclass(frozen=True)
class EWMAZScoreParams:
    """Parameters of :class:`EWMAZScore`."""

    alpha: float = field(default=0.02, metadata=bounds(1e-6, 1.0))
    """Smoothing factor of the mean and variance; memory is about ``1 / alpha`` samples."""
    warmup: int = field(default=10, metadata=bounds(1, 1_000_000))
    """A feature scores 0 until it has been learned this many times."""
    clip_z: float = field(default=6.0, metadata=bounds(1.0, 1e6))
    """Learned values are winsorised to ``mean +- clip_z * std`` so one spike cannot blow up
    the variance and mask the next one; level shifts are still absorbed within a few dozen samples."""
    min_std: float = field(default=1e-6, metadata=bounds(1e-12, None))
    """Absolute floor of the standard deviation (constant series do not divide by zero)."""
    rel_min_std: float = field(default=0.01, metadata=bounds(0.0, None))
    """Floor of the standard deviation relative to ``|mean|``: a GPU pinned at exactly 65 C
    that reads 66 C once is not a 10^6-sigma event."""


class EWMAZScore(AnomalyDetector):
    """Largest absolute z-score across features, against exponentially weighted statistics.

    Each feature keeps an exponentially weighted mean and variance.  For the first
    ``1 / alpha`` samples the weight is ``1 / n`` (exact running mean and variance), afterwards
    ``alpha``, which removes the start-up bias of a plain EWMA.  The score is
    ``max_f |x_f - mean_f| / std_f`` over the features present in the sample; absent or
    non-finite features are skipped, unseen ones score 0.

    Parameters
    ----------
    alpha, warmup, clip_z, min_std, rel_min_std
        See :class:`EWMAZScoreParams`.

    Examples
    --------
    >>> d = EWMAZScore(alpha=0.05)
    >>> for i in range(200):  # warm-up on a steady GPU
    ...     x = {"temp_c": 60 + (i % 5) * 0.5, "power_w": 300 + (i % 7) * 3.0}
    ...     d.learn_one(x)
    >>> round(d.score_one({"temp_c": 60.5, "power_w": 303.0}), 2)
    0.97
    >>> round(d.score_one({"temp_c": 85.0, "power_w": 120.0}), 1)
    33.9
    >>> d.score_one({})  # nothing usable: no evidence
    0.0

    References
    ----------
    Finch, T. (2009). *Incremental calculation of weighted mean and variance*. University of
    Cambridge Computing Service.
    """

    Params = EWMAZScoreParams

    def reset(self) -> None:
        # feature -> [count, mean, variance]; a list so updates are in place.
        self._stats: dict[str, list[float]] = {}

    def _std(self, mean: float, var: float) -> float:
        p = self.params
        return max(math.sqrt(max(var, 0.0)), p.min_std, p.rel_min_std * abs(mean))

    def score_features(self, x: Mapping[str, float]) -> dict[str, float]:
        """Per-feature ``|z|`` of ``x`` (which metric triggered); warming-up features are 0."""
        out = {}
        for key, value in clean_sample(x).items():
            st = self._stats.get(key)
            if st is None or st[0] < self.params.warmup:
                out[key] = 0.0
                continue
            out[key] = finite_score(abs(value - st[1]) / self._std(st[1], st[2]))
        return out

    def score_one(self, x: Mapping[str, float]) -> float:
        return max(self.score_features(x).values(), default=0.0)

    def learn_one(self, x: Mapping[str, float]) -> None:
        p = self.params
        for key, value in clean_sample(x).items():
            st = self._stats.setdefault(key, [0.0, 0.0, 0.0])
            count, mean, var = st
            if count >= p.warmup:
                bound = p.clip_z * self._std(mean, var)
                value = min(max(value, mean - bound), mean + bound)
            count += 1
            a = max(p.alpha, 1.0 / count)
            diff = value - mean
            incr = a * diff
            new_var = (1.0 - a) * (var + diff * incr)
            # A reading near the float limit would overflow the variance to inf and blind the
            # feature for good; such a value is dropped instead.
            if math.isfinite(new_var):
                st[0], st[1], st[2] = count, mean + incr, new_var

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {}
        yield {"alpha": 0.1, "warmup": 5, "clip_z": 3.0}
