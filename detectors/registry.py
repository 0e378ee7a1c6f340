"""Metric anomaly detectors by name.

The name is what the worker config (``anomaly_detector``), a CLI flag and the ``detector``
evidence of a detection use.  Unknown detector names and unknown or out-of-range params are
:class:`trainguard.schemas.config.ConfigError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainguard.detectors.anomaly import Autoencoder, EWMAZScore, RobustZScore, WindowedIsolationForest
from trainguard.detectors.base import AnomalyDetector
from trainguard.schemas.config import ConfigError, load_config


@dataclass(frozen=True)
class Registration:
    """One registered detector class."""

    name: str
    cls: type[AnomalyDetector]


_REGISTRY: dict[str, Registration] = {}


def register(name: str, cls: type[AnomalyDetector]) -> None:
    """Add ``cls`` under ``name``; names are unique (re-registering the same class is a no-op)."""
    existing = _REGISTRY.get(name)
    if existing is not None and existing.cls is not cls:
        raise ValueError(f"detector name {name!r} already registered for {existing.cls.__name__}")
    _REGISTRY[name] = Registration(name, cls)


def registered() -> dict[str, Registration]:
    """Snapshot of the registry, by name.

    >>> sorted(registered())
    ['autoencoder', 'ewma_zscore', 'isolation_forest', 'robust_zscore']
    """
    return dict(_REGISTRY)


def get(name: str) -> type[AnomalyDetector]:
    """The class registered as ``name``."""
    try:
        return _REGISTRY[name].cls
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ConfigError(f"unknown detector {name!r} (known: {known})") from None


def check_params(name: str, params: Mapping[str, Any] | None = None) -> None:
    """Raise :class:`ConfigError` unless ``name`` is registered and takes ``params`` -- without
    building it (an autoencoder imports torch when built: a config check must not).

    >>> check_params("isolation_forest", {"window_size": 64})
    >>> check_params("isolation_forest", {"alpha": 0.1})
    Traceback (most recent call last):
    ...
    trainguard.schemas.config.ConfigError: WindowedIsolationForestParams: unknown field(s) 'alpha'
    """
    load_config(get(name).Params, dict(params or {}))


def build(name: str, params: Mapping[str, Any] | None = None) -> AnomalyDetector:
    """A fresh detector ``name`` built with ``params``.

    >>> build("ewma_zscore", {"alpha": 0.1})
    EWMAZScore(alpha=0.1, warmup=10, clip_z=6.0, min_std=1e-06, rel_min_std=0.01)
    >>> build("ewma_zscore", {"alpah": 0.1})
    Traceback (most recent call last):
    ...
    trainguard.schemas.config.ConfigError: EWMAZScoreParams: unknown field(s) 'alpah'
    """
    return get(name)(**dict(params or {}))


register("ewma_zscore", EWMAZScore)
register("isolation_forest", WindowedIsolationForest)
# Long median/MAD baseline: keeps scoring a regime change the EWMA has already absorbed (#41).
register("robust_zscore", RobustZScore)
# Imports torch when built (not when registered), and only pays off on multivariate samples.
register("autoencoder", Autoencoder)
