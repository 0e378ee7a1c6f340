"""Turning anomaly scores into yes/no decisions, kept apart from the detectors that score.

A detector's score is a continuous, threshold-free quantity; *where* to cut it is configuration
(it differs per metric, cluster and tolerance for false evictions).  A filter wraps one detector,
adds ``classify(score) -> bool`` and, with ``protect_anomaly_detector``, stops samples it flags
from being learned, so a burst of faulty readings does not become the new normal.  Modelled on
``river/anomaly/filter.py``, plus a guard river lacks: after ``relearn_after`` consecutive flagged
samples the detector learns again, because a shift that persists that long is a new regime
(a replaced GPU, a new parallelism layout), and refusing to learn it would flag forever.

The anomaly stage (:class:`trainguard.detectors.node_anomaly.NodeAnomalyScorer`) runs each node's detector
behind a :class:`ThresholdFilter`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainguard.detectors.base import AnomalyDetector
from trainguard.schemas.config import load_config
from trainguard.schemas.typecheck import bounds


@dataclass(frozen=True)
class ThresholdFilterParams:
    """Parameters of :class:`ThresholdFilter`."""

    threshold: float = field(metadata=bounds())
    """Scores at or above this are anomalies."""
    protect_anomaly_detector: bool = True
    """Do not learn samples classified as anomalies."""
    relearn_after: int | None = field(default=None, metadata=bounds(0, None))
    """Learn again after this many consecutive anomalies (``None``: never)."""


class ThresholdFilter:
    """Fixed threshold on the score of ``detector``.

    Examples
    --------
    >>> from trainguard.detectors.anomaly import EWMAZScore
    >>> f = ThresholdFilter(EWMAZScore(), threshold=6.0)
    >>> for i in range(100):
    ...     _ = f.process_one({"temp_c": 60 + (i % 5) * 0.5})
    >>> f.process_one({"temp_c": 90.0})  # flagged, and kept out of the baseline
    (40.99..., True)
    >>> f.process_one({"temp_c": 60.5})
    (0.7..., False)
    """

    def __init__(self, detector: AnomalyDetector, **params: Any) -> None:
        self.detector = detector
        self.params = load_config(ThresholdFilterParams, params)
        self._flagged_run = 0

    def classify(self, score: float) -> bool:
        """Whether ``score`` is an anomaly."""
        return score >= self.params.threshold

    def process_one(self, x: Mapping[str, float]) -> tuple[float, bool]:
        """Score ``x``, decide, then learn it unless protected; one scoring call per sample."""
        score = self.detector.score_one(x)
        flagged = self.classify(score)
        self._flagged_run = self._flagged_run + 1 if flagged else 0
        relearn = self.params.relearn_after
        protected = self.params.protect_anomaly_detector and flagged
        if not protected or (relearn is not None and self._flagged_run > relearn):
            self.detector.learn_one(x)
        return score, flagged

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.detector!r}, {self.params!r})"
