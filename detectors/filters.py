"""Turning anomaly scores into yes/no decisions, kept apart from the detectors that score.

A detector's score is a continuous, threshold-free quantity; *where* to cut it is configuration
(it differs per metric, cluster and tolerance for false evictions).  A filter wraps one detector,
adds ``classify(score) -> bool`` and, with ``protect_anomaly_detector``, stops samples it flags
from being learned, so a burst of faulty readings does not become the new normal.  Modelled on
``river/anomaly/filter.py``, plus a guard river lacks: after ``relearn_after`` consecutive flagged
samples the detector learns again, because a shift that persists that long is a new regime
(a replaced GPU, a new parallelism layout), and refusing to learn it would flag forever.
"""

from __future__ import annotations

import abc
import bisect
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from detectors.base import AnomalyDetector
from schemas.config import load_config
from schemas.typecheck import rng


class AnomalyFilter(abc.ABC):
    """Base: delegates scoring to ``detector`` and decides with :meth:`classify`."""

    Params: ClassVar[type[Any]]

    def __init__(self, detector: AnomalyDetector, **params: Any) -> None:
        self.detector = detector
        self.params = load_config(self.Params, params)
        self._flagged_run = 0

    def score_one(self, x: Mapping[str, float]) -> float:
        return self.detector.score_one(x)

    @abc.abstractmethod
    def classify(self, score: float) -> bool:
        """Whether ``score`` is an anomaly under the current threshold."""

    @abc.abstractmethod
    def _observe(self, score: float) -> None:
        """Record ``score`` (once per sample) for filters whose threshold depends on past scores."""

    def process_one(self, x: Mapping[str, float]) -> tuple[float, bool]:
        """Score ``x``, decide, then learn it unless protected; one scoring call per sample.

        Use this in a stream instead of ``score_one`` + ``learn_one``, which score twice.
        """
        score = self.score_one(x)
        flagged = self.classify(score)
        self._flagged_run = self._flagged_run + 1 if flagged else 0
        relearn = self.params.relearn_after
        protected = self.params.protect_anomaly_detector and flagged
        if not protected or (relearn is not None and self._flagged_run > relearn):
            self.detector.learn_one(x)
        self._observe(score)
        return score, flagged

    def learn_one(self, x: Mapping[str, float]) -> None:
        self.process_one(x)

    def reset(self) -> None:
        self.detector.reset()
        self._flagged_run = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.detector!r}, {self.params!r})"


@dataclass(frozen=True)
class ThresholdFilterParams:
    """Parameters of :class:`ThresholdFilter`."""

    threshold: float = field(metadata=rng())
    """Scores at or above this are anomalies."""
    protect_anomaly_detector: bool = True
    """Do not learn samples classified as anomalies."""
    relearn_after: int | None = field(default=None, metadata=rng(0, None))
    """Learn again after this many consecutive anomalies (``None``: never)."""


class ThresholdFilter(AnomalyFilter):
    """Fixed threshold on the score of ``detector``.

    Examples
    --------
    >>> from detectors.anomaly import EWMAZScore
    >>> f = ThresholdFilter(EWMAZScore(), threshold=6.0)
    >>> for i in range(100):
    ...     _ = f.process_one({"temp_c": 60 + (i % 5) * 0.5})
    >>> f.process_one({"temp_c": 90.0})  # flagged, and kept out of the baseline
    (40.99..., True)
    >>> f.process_one({"temp_c": 60.5})
    (0.7..., False)
    """

    Params = ThresholdFilterParams

    def classify(self, score: float) -> bool:
        return score >= self.params.threshold

    def _observe(self, score: float) -> None:
        """A fixed threshold keeps no score history."""


@dataclass(frozen=True)
class QuantileFilterParams:
    """Parameters of :class:`QuantileFilter`."""

    q: float = field(metadata=rng(0.0, 1.0))
    """Scores at or above the ``q`` quantile of recent scores are anomalies."""
    window: int = field(default=1000, metadata=rng(1, 10_000_000))
    """How many recent scores the quantile is taken over."""
    min_scores: int = field(default=50, metadata=rng(1, 10_000_000))
    """Nothing is flagged before this many scores were seen."""
    protect_anomaly_detector: bool = True
    relearn_after: int | None = field(default=None, metadata=rng(0, None))


class QuantileFilter(AnomalyFilter):
    """Threshold = the ``q`` quantile of the last ``window`` scores (an alarm budget, not a value).

    Useful when scores have no natural unit (Isolation Forest, autoencoder): ``q=0.999`` means
    "at most about one alarm per thousand samples while the score distribution is stable".

    Examples
    --------
    >>> from detectors.anomaly import EWMAZScore
    >>> f = QuantileFilter(EWMAZScore(), q=0.99, window=500)
    >>> for i in range(300):
    ...     _ = f.process_one({"temp_c": 60 + (i % 5) * 0.5})
    >>> round(f.threshold, 2)
    1.51
    >>> f.process_one({"temp_c": 90.0})
    (40.99..., True)
    """

    Params = QuantileFilterParams

    def __init__(self, detector: AnomalyDetector, **params: Any) -> None:
        super().__init__(detector, **params)
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []

    @property
    def threshold(self) -> float:
        """Current cut-off (``inf`` until ``min_scores`` scores were seen)."""
        n = len(self._sorted)
        if n < self.params.min_scores:
            return math.inf
        return self._sorted[math.ceil(self.params.q * (n - 1))]

    def classify(self, score: float) -> bool:
        return score >= self.threshold

    def _observe(self, score: float) -> None:
        self._recent.append(score)
        bisect.insort(self._sorted, score)
        if len(self._recent) > self.params.window:
            old = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def reset(self) -> None:
        super().reset()
        self._recent.clear()
        self._sorted.clear()
