"""Metric anomaly detectors by name, each with a default enabled/disabled state.

Like node_exporter's ``registerCollector(name, defaultEnabled, factory)``: the name is what a
config file, a CLI flag and the ``detector`` column of a score row use, and the default says what
runs when the config does not mention it.  Heavy or input-specific detectors start disabled.

A config section looks like::

    detectors:
      isolation_forest: {params: {refit_every: 256}}
      autoencoder: {enabled: true}

Unknown detector names, unknown keys and unknown or out-of-range params are
:class:`schemas.config.ConfigError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from detectors.anomaly import Autoencoder, EWMAZScore, WindowedIsolationForest
from detectors.base import AnomalyDetector
from schemas.config import ConfigError, load_config


@dataclass(frozen=True)
class Registration:
    """One registered detector class and whether it runs when the config is silent."""

    name: str
    cls: type[AnomalyDetector]
    default_enabled: bool


@dataclass(frozen=True)
class DetectorConfig:
    """Per-detector config entry: on/off (``None``: the default) and constructor params."""

    enabled: bool | None = None
    params: dict[str, Any] = field(default_factory=dict)


_REGISTRY: dict[str, Registration] = {}


def register(name: str, cls: type[AnomalyDetector], *, default_enabled: bool) -> None:
    """Add ``cls`` under ``name``; names are unique (re-registering the same class is a no-op)."""
    existing = _REGISTRY.get(name)
    if existing is not None and existing.cls is not cls:
        raise ValueError(f"detector name {name!r} already registered for {existing.cls.__name__}")
    _REGISTRY[name] = Registration(name, cls, default_enabled)


def registered() -> dict[str, Registration]:
    """Snapshot of the registry, by name.

    >>> {n: r.default_enabled for n, r in sorted(registered().items())}
    {'autoencoder': False, 'ewma_zscore': True, 'isolation_forest': True}
    """
    return dict(_REGISTRY)


def get(name: str) -> type[AnomalyDetector]:
    """The class registered as ``name``."""
    try:
        return _REGISTRY[name].cls
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ConfigError(f"unknown detector {name!r} (known: {known})") from None


def build(name: str, params: Mapping[str, Any] | None = None) -> AnomalyDetector:
    """A fresh detector ``name`` built with ``params``.

    >>> build("ewma_zscore", {"alpha": 0.1})
    EWMAZScore(alpha=0.1, warmup=10, clip_z=6.0, min_std=1e-06, rel_min_std=0.01)
    >>> build("ewma_zscore", {"alpah": 0.1})
    Traceback (most recent call last):
    ...
    schemas.config.ConfigError: EWMAZScoreParams: unknown field(s) 'alpah'
    """
    return get(name)(**dict(params or {}))


def build_enabled(config: Mapping[str, Any] | None = None) -> dict[str, AnomalyDetector]:
    """Every enabled detector, by name, from a ``{name: {enabled, params}}`` mapping.

    >>> sorted(build_enabled({"autoencoder": {"enabled": True}, "isolation_forest": {"enabled": False}}))
    ['autoencoder', 'ewma_zscore']
    """
    config = dict(config or {})
    for name in config:
        get(name)  # unknown names fail before anything is built
    out = {}
    for name, reg in sorted(_REGISTRY.items()):
        entry = load_config(DetectorConfig, config.get(name) or {})
        enabled = reg.default_enabled if entry.enabled is None else entry.enabled
        if enabled:
            out[name] = build(name, entry.params)
    return out


register("ewma_zscore", EWMAZScore, default_enabled=True)
register("isolation_forest", WindowedIsolationForest, default_enabled=True)
# Off by default: pulls in torch, and it only pays off on multivariate samples.
register("autoencoder", Autoencoder, default_enabled=False)
