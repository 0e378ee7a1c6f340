"""The metric names TrainGuard's components expose, read from their real registries.

The alert rules (infra/deploy/prometheus) and the Grafana dashboard (infra/deploy/grafana) name
metrics by string; their tests check every such name against what a stream worker (its built
Faust app), a node exporter and an action service (their services, built, not started) register.
A renamed metric then fails a test instead of an alert that silently never fires.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from trainguard.infra.config import KafkaConfig, load_settings

#: the sample names a metric family of each type exposes (``<name><suffix>``).
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "gauge": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}
#: metric names in PromQL or prose: TrainGuard's own all start so.
METRIC = re.compile(r"\btrainguard_[a-z0-9_]+\b")
DEPLOY = Path(__file__).resolve().parents[2] / "infra" / "deploy"


def exposed(registry: CollectorRegistry) -> set[str]:
    """Every sample name ``registry`` exposes (labelled metrics without children included)."""
    out: set[str] = set()
    for family in registry.collect():
        for suffix in _SUFFIXES[family.type]:
            out.add(family.name + suffix)
    return out


def used(text: str) -> set[str]:
    """The TrainGuard metric names mentioned in ``text`` (a PromQL expression, an annotation)."""
    return set(METRIC.findall(text))


class _NoProducer:
    """The action service's producer, never used: the service is built, not run."""

    def send(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("the metric-names check publishes nothing")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def component_names(tmp: Path) -> dict[str, set[str]]:
    """Component -> the metric names it exposes: worker, exporter, actions."""
    from trainguard.actions.config import ActionsConfig
    from trainguard.actions.service import ActionService
    from trainguard.streams.app import build_app
    from trainguard.streams.config import WorkerConfig
    from trainguard.streams.exporter.config import load_exporter_config
    from trainguard.streams.exporter.service import ExporterService

    base = load_settings(environ={})
    settings = dataclasses.replace(
        base,
        stack=dataclasses.replace(base.stack, home=str(tmp / "home")),
        signing=dataclasses.replace(base.signing, enabled=False),
    )
    worker = build_app(settings, WorkerConfig(app_id="metric-names", web_port=0))
    exporter_cfg = load_exporter_config(
        {
            "state_dir": str(tmp / "exporter"),
            "reporter": {"socket": str(tmp / "r.sock")},
            "commands": {"enabled": False},
            "nvml": {"enabled": False},
        },
        environ={},
    )
    exporter = ExporterService(exporter_cfg, KafkaConfig())
    actions = ActionService(
        settings,
        ActionsConfig(state_dir=str(tmp / "actions")),
        producer=_NoProducer(),  # type: ignore[arg-type]
    )
    try:
        return {
            "worker": exposed(worker.ctx.metrics.registry),
            "exporter": exposed(exporter.metrics.registry),
            "actions": exposed(actions.metrics.registry),
        }
    finally:
        exporter.spool.close()
        actions.shutdown()
