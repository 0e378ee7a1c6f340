"""The Faust application of a TrainGuard stream worker: configuration and agent wiring.

``build_app`` creates the app from the project's settings and registers every agent; several
workers started with the same ``app_id`` form one consumer group and share the partitions.  The
worker's web server serves ``/metrics`` (Prometheus) and ``/healthz`` (progress-based liveness).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import faust
from prometheus_client import generate_latest

from infra.config import Settings
from streams.agents import aggregation, anomaly, control, decide, inspection, sink, training
from streams.config import WorkerConfig
from streams.context import WorkerContext
from streams.jobs import JobDirectory
from streams.kafka_compat import faust_broker

log = logging.getLogger(__name__)


@dataclass
class Worker:
    """A built app and the live objects its agents use (exposed for tests and metrics)."""

    app: Any
    ctx: WorkerContext
    monitors: training.Monitors
    policy: Any
    inspector: Any


def build_app(settings: Settings, cfg: WorkerConfig) -> Worker:
    broker, credentials = faust_broker(settings.kafka)
    app = faust.App(
        cfg.app_id,
        broker=broker,
        broker_credentials=credentials,
        store="memory://",
        autodiscover=False,
        # Topics come from the registry and are created by `stack up`; Faust creates only its
        # own internal topics.
        topic_allow_declare=False,
        topic_disable_leader=True,
        consumer_auto_offset_reset=cfg.auto_offset_reset,
        broker_session_timeout=cfg.session_timeout_s,
        broker_heartbeat_interval=cfg.heartbeat_interval_s,
        broker_commit_every=500,
        broker_commit_interval=1.0,
        web_enabled=cfg.web_port > 0,
        web_port=cfg.web_port or 6066,
        web_bind=cfg.web_host,
        web_host=cfg.web_host,
        producer_acks=-1,
        stream_wait_empty=False,
    )
    ctx = WorkerContext(settings=settings, cfg=cfg, app=app)
    jobs = JobDirectory(settings.clickhouse)
    inspector = inspection.register(ctx)
    monitors = training.register(ctx)
    policy = decide.register(ctx, jobs)
    aggregation.register(ctx, jobs)
    anomaly.register(ctx)
    if cfg.sink_enabled:
        sink.register(ctx, jobs)

    def on_change(new: WorkerConfig) -> None:
        monitors.reconfigure()
        policy.config = new.decide
        inspector.host = new.host

    control.register(ctx, on_change)
    _register_web(ctx)
    _register_lag(ctx)
    return Worker(app, ctx, monitors, policy, inspector)


def _register_web(ctx: WorkerContext) -> None:
    app = ctx.app

    @app.page("/metrics")
    async def metrics(web: Any, request: Any) -> Any:
        return web.bytes(generate_latest(ctx.metrics.registry), content_type="text/plain; version=0.0.4")

    @app.page("/healthz")
    async def healthz(web: Any, request: Any) -> Any:
        stalled = ctx.metrics.stalled_agents(ctx.cfg.liveness_stall_s, ctx.started_at)
        body = {
            "ok": not stalled,
            "stalled_agents": stalled,
            "lag": ctx.metrics.total_lag(),
            "uptime_s": round(time.time() - ctx.started_at, 1),
        }
        return web.json(body, status=200 if not stalled else 503)


def _register_lag(ctx: WorkerContext) -> None:
    @ctx.app.timer(5.0)
    async def measure_lag() -> None:
        consumer = ctx.app.consumer
        per_topic: dict[str, float] = {}
        try:
            assignment = consumer.assignment()
        except Exception:
            return
        for tp in assignment:
            high = consumer.highwater(tp)
            if high is None:
                continue
            key = (tp.topic, tp.partition)
            pos = ctx.positions.get(key)
            if pos is None:
                # Nothing processed from this partition yet: what arrived since we first saw it.
                pos = ctx.first_highwater.setdefault(key, high) - 1
            behind = high - (pos + 1)
            per_topic[tp.topic] = per_topic.get(tp.topic, 0) + max(behind, 0)
        for topic, lag in per_topic.items():
            ctx.metrics.set_lag(topic, lag)
