"""The Faust application of a TrainGuard stream worker: configuration and agent wiring.

``build_app`` creates the app from the project's settings and registers every agent; several
workers started with the same ``app_id`` form one consumer group and share the partitions.  The
agents share one :class:`~trainguard.detectors.routing.DetectionPath` (the routing the offline replay uses
too).  The ClickHouse sink (:class:`trainguard.infra.sink.Sink`) runs beside them in a thread of its own,
with a consumer group of its own (``<app_id>-sink``): a ClickHouse outage holds up the sink,
never the detection agents.  With ``sink_process`` it runs as ``trainguard sink`` instead, a
process of its own in the same group.  The worker's web server serves ``/metrics`` (Prometheus) and
``/healthz`` (progress-based liveness of every agent and of the sink).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import faust
import mode
from prometheus_client import generate_latest

from trainguard.detectors.keyed_state import PathState
from trainguard.detectors.routing import DetectionPath
from trainguard.infra.config import Settings
from trainguard.infra.sink import SinkThread
from trainguard.schemas.topics import namespaced
from trainguard.streams import jobs as job_specs
from trainguard.streams import priority
from trainguard.streams.agents import aggregation, control, decide, inspection, training
from trainguard.streams.config import WorkerConfig, sink_config
from trainguard.streams.context import WorkerContext
from trainguard.streams.jobs import JobDirectory
from trainguard.streams.kafka_compat import faust_broker
from trainguard.streams.loop_watch import LoopWatch
from trainguard.streams.metrics import JobCollector, SinkMetrics
from trainguard.streams.state import WorkerState

log = logging.getLogger(__name__)


@dataclass
class Worker:
    """A built app and the live objects its agents use (exposed for tests and metrics)."""

    app: Any
    ctx: WorkerContext
    path: DetectionPath
    jobs: JobDirectory
    #: None when ``sink_enabled`` is off or the sink runs as a process of its own (``sink_process``).
    sink: SinkThread | None


def build_app(settings: Settings, cfg: WorkerConfig) -> Worker:
    broker, credentials = faust_broker(settings.kafka)
    datadir = settings.stack.home_path / "worker" / f"{cfg.app_id}-data"
    datadir.parent.mkdir(parents=True, exist_ok=True)  # Faust creates the last level only
    app = faust.App(
        cfg.app_id,
        broker=broker,
        broker_credentials=credentials,
        store="memory://",
        # Faust keeps its table and leader state in ``datadir``; its default (``<app_id>-data``
        # in the working directory) littered whatever directory a worker was started from.
        datadir=str(datadir),
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
        broker_max_poll_records=cfg.max_poll_records or None,
    )
    if cfg.urgent_first:
        priority.install(app, {namespaced(name, cfg.topic_namespace) for name in priority.BULK_TOPICS})
    ctx = WorkerContext(settings=settings, cfg=cfg, app=app)
    jobs = JobDirectory(settings.clickhouse)
    path = DetectionPath(cfg)
    ctx.metrics.registry.register(JobCollector(path))
    state = WorkerState(ctx, PathState(path)) if cfg.state_enabled else None
    inspection.register(ctx, path, state)
    training.register(ctx, path, state)
    decide.register(ctx, path, jobs, state)
    aggregation.register(ctx, path, jobs, state)
    job_specs.follow(ctx, jobs)
    sink = _register_sink(ctx) if cfg.sink_enabled and not cfg.sink_process else None

    def on_change(new: WorkerConfig) -> None:
        path.reconfigure(new)

    control.register(ctx, on_change)
    if cfg.loop_block_warn_s > 0:
        _register_loop_watch(ctx)
    _register_web(ctx, sink)
    _register_lag(ctx)
    _register_offsets(ctx)
    return Worker(app, ctx, path, jobs, sink)


def _register_sink(ctx: WorkerContext) -> SinkThread:
    """The sink thread, started and stopped with the app; its group is ``<app_id>-sink``."""
    cfg = ctx.cfg
    sink_cfg = sink_config(cfg)
    runner = SinkThread(ctx.settings, sink_cfg, SinkMetrics(ctx.metrics), cfg.auto_offset_reset)

    class SinkService(mode.Service):
        async def on_start(self) -> None:
            runner.start()

        async def on_stop(self) -> None:
            await asyncio.get_running_loop().run_in_executor(None, runner.stop)

    ctx.app.service(SinkService)
    return runner


def _register_loop_watch(ctx: WorkerContext) -> None:
    """Log where the event loop is when it stops running (:mod:`trainguard.streams.loop_watch`)."""
    counter = ctx.metrics.loop_blocked

    class LoopWatchService(mode.Service):
        watch: LoopWatch | None = None

        async def on_start(self) -> None:
            block_s = ctx.cfg.loop_block_warn_s
            self.watch = LoopWatch(asyncio.get_running_loop(), block_s, min(0.1, block_s / 4), counter.inc)
            self.watch.start()

        async def on_stop(self) -> None:
            if self.watch is not None:
                self.watch.stop()

    ctx.app.service(LoopWatchService)


def _register_web(ctx: WorkerContext, sink: SinkThread | None) -> None:
    app = ctx.app

    @app.page("/metrics")
    async def metrics(web: Any, request: Any) -> Any:
        return web.bytes(generate_latest(ctx.metrics.registry), content_type="text/plain; version=0.0.4")

    @app.page("/healthz")
    async def healthz(web: Any, request: Any) -> Any:
        body = ctx.metrics.health(ctx.cfg.liveness_stall_s, ctx.started_at, sink)
        return web.json(body, status=200 if body["ok"] else 503)


#: a partition with records past its expected offset and none delivered this long is sought there.
STUCK_PARTITION_S = 20.0
#: the longest the agents wait for a new assignment's committed offsets (then they go on without).
COMMITTED_TIMEOUT_S = 15.0
#: an agent at one record this long (a long fill, a state restore) holds Faust's fetch loop for
#: every agent: the silence of the other partitions is then no skip, and none is sought.
AGENT_BUSY_S = 5.0


def _register_offsets(ctx: WorkerContext) -> None:
    """Where each input partition's records are expected from (:mod:`trainguard.streams.offsets`):
    the committed offsets of partitions new to the worker, read before the agents take a record of
    the assignment; and a timer that seeks a partition whose records stopped coming."""
    loading: list[asyncio.Task[None]] = []

    async def load(new: set[tuple[str, int]]) -> None:
        try:
            found = await asyncio.wait_for(ctx.committed_offsets(new), COMMITTED_TIMEOUT_S)
            for (topic, partition), offset in found.items():
                ctx.offsets.start(topic, partition, offset)
        except asyncio.CancelledError:
            raise  # a newer assignment took over: it sets ``offsets_ready``
        except Exception as exc:  # the broker away: those partitions start where they deliver
            log.warning("committed offsets of %d new partition(s) not read: %s", len(new), exc)
        ctx.offsets_ready.set()

    @ctx.app.on_partitions_assigned.connect
    async def on_assigned(app_: Any, assigned: Any, **_: Any) -> None:
        inputs = {(tp.topic, tp.partition) for tp in assigned if tp.topic in ctx.registry}
        new = ctx.offsets.assigned(inputs)
        for task in loading:
            task.cancel()  # an older assignment's: this one replaces it
        loading.clear()
        if not new:
            ctx.offsets_ready.set()
            return
        ctx.offsets_ready.clear()
        loading.append(asyncio.ensure_future(load(new)))

    @ctx.app.timer(5.0)
    async def seek_stuck_partitions() -> None:
        from faust.types import TP

        consumer = ctx.app.consumer
        if ctx.longest_in_guard_s() >= AGENT_BUSY_S:
            return  # one agent stalls the fetch loop; a seek now would re-deliver queued records
        try:
            parts = [tp for tp in consumer.assignment() if tp.topic in ctx.registry]
            ends = await asyncio.wait_for(consumer.highwaters(*parts), 2.0) if parts else {}
        except Exception:  # the broker away: nothing is coming anyway
            return
        highs = {(tp.topic, tp.partition): int(end) for tp, end in ends.items() if end is not None}
        for (topic, partition), offset in ctx.offsets.stuck(highs, STUCK_PARTITION_S):
            high = highs[(topic, partition)]
            if not faust_went_past(consumer, TP(topic, partition), offset):
                # Faust has not read that far: it lags (a fetch loop held by a slow agent's full
                # queue starves every partition), it skipped nothing.  A seek would not help and,
                # repeated, kept an overloaded worker's telemetry silent for minutes (demo run
                # 20261128-141341: 114 seeks of 21 partitions, each 20-30 s apart).
                continue
            try:
                there = await asyncio.wait_for(ctx.read_range(topic, partition, offset, high, limit=1), 10.0)
                if not there:  # transaction markers only: nothing to deliver
                    ctx.offsets.filled(topic, partition, high)
                    continue
                ctx.metrics.stuck_seeks.inc()
                log.warning(
                    "%s[%d] delivered nothing for %.0f s with records from offset %d on: seeking there",
                    topic, partition, STUCK_PARTITION_S, offset,
                )  # fmt: skip
                # Through the consumer's own thread (aiokafka is not thread-safe).
                await consumer.seek_wait({TP(topic, partition): offset})
            except Exception as exc:
                log.error(
                    "%s[%d]: looking at or seeking to offset %d failed: %s", topic, partition, offset, exc
                )


def faust_went_past(consumer: Any, tp: Any, offset: int) -> bool:
    """Whether Faust's consumer has passed a record after ``offset`` of ``tp`` on to the agents'
    streams -- the agent never got ``offset``, so it was skipped, not merely not fetched yet.

    Faust's read offset is the last offset its fetch loop delivered, or the offset it was sought
    to (the committed one after a rebalance, ours after a seek): hence strictly past.  Unknown
    (a consumer class without it): True."""
    read_offsets = getattr(consumer, "_read_offset", None)
    if read_offsets is None:
        return True
    last = read_offsets.get(tp)
    return last is not None and int(last) > offset


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
            if tp.topic not in ctx.registry:  # Faust's own topics (state changelogs): not agents' input
                continue
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
