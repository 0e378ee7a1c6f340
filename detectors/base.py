"""The streaming anomaly-detector contract shared by every metric detector.

A detector sees one sample at a time as a flat ``{feature: value}`` dict (one node's GPU
temperature, power, NIC throughput, ...).  ``score_one`` says how unusual the sample is (higher
means more anomalous, never NaN) and ``learn_one`` folds it into the baseline.  Deciding whether
a score *is* an anomaly is someone else's job (:mod:`trainguard.detectors.filters`), so thresholds stay
configuration and scores stay comparable across thresholds.  Modelled on
``river.base.AnomalyDetector``.

Parameters live in one frozen dataclass per detector (``Params``), validated by
:func:`trainguard.schemas.config.load_config`: unknown names and out-of-range values are errors, and the
same dataclass is what the registry builds from a config file.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Self

from trainguard.schemas.config import load_config


def clean_sample(x: Any) -> dict[str, float]:
    """Keep the usable part of a sample: string keys with finite numeric values.

    Exporters drop fields and emit NaN when a sensor read fails; a detector treats such a field as
    missing rather than crashing or poisoning its baseline.

    >>> clean_sample({"temp": 61, "power": float("nan"), "util": "n/a", "ok": True})
    {'temp': 61.0}
    >>> clean_sample(None)
    {}
    """
    if not isinstance(x, Mapping):
        return {}
    out = {}
    for key, value in x.items():
        # bool is an int subclass but a flag, not a measurement.
        if isinstance(key, str) and isinstance(value, int | float) and not isinstance(value, bool):
            value = float(value)
            if math.isfinite(value):
                out[key] = value
    return out


def finite_score(value: float, cap: float = 1e12) -> float:
    """Clamp a raw score to a finite, non-negative float (NaN counts as "no evidence")."""
    if not math.isfinite(value):
        return cap if value > 0 else 0.0
    return min(max(float(value), 0.0), cap)


class AnomalyDetector(abc.ABC):
    """Base class: an online detector with ``learn_one`` / ``score_one``.

    Subclasses set ``Params`` (a frozen dataclass whose defaults are the detector's defaults),
    implement :meth:`reset` to (re)create the learned state and the two ``*_one`` methods.
    Constructor keywords are the ``Params`` fields; anything else raises
    :class:`trainguard.schemas.config.ConfigError`.

    Streaming use is *score, then learn*, so a sample is never judged against a baseline that
    already contains it::

        for x in stream:
            s = detector.score_one(x)
            detector.learn_one(x)
    """

    Params: ClassVar[type[Any]]

    def __init__(self, **params: Any) -> None:
        self.params = load_config(self.Params, params)
        self.reset()

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget everything learned; the detector behaves as if freshly built."""

    @abc.abstractmethod
    def learn_one(self, x: Mapping[str, float]) -> None:
        """Update the baseline with sample ``x``; unusable fields are ignored."""

    @abc.abstractmethod
    def score_one(self, x: Mapping[str, float]) -> float:
        """Anomaly score of ``x`` (finite, >= 0, higher = more anomalous); never mutates state."""

    def clone(self, **overrides: Any) -> Self:
        """A fresh, untrained detector with the same parameters (``overrides`` replace some)."""
        return type(self)(**{**self.get_params(), **overrides})

    def get_params(self) -> dict[str, Any]:
        """The validated parameters as a plain dict (what :meth:`clone` and the registry use)."""
        return {name: getattr(self.params, name) for name in self.params.__dataclass_fields__}

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        """Parameter sets the contract test builds the detector with (small and fast)."""
        yield {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"
