"""``trainguard sink``: the ClickHouse sink of the stream workers as a process of its own.

A worker runs the sink (:class:`trainguard.infra.sink.Sink`) in a thread by default, where its kafka-python
consumer, its decoding and its row building share the worker's core and GIL with the detection
agents (about a quarter of the worker's CPU at 1,200 machines).  With ``worker.sink_process: true``
the workers run none, and this command runs it instead, in the same consumer group
(``<app_id>-sink``, :func:`trainguard.streams.config.sink_config`): several of them share the partitions, and
switching between the two keeps the committed offsets.  Same config file and variables as the
worker (the ``worker`` section).  ``/metrics`` and ``/healthz`` as the worker's, for the sink.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import click

from trainguard.context import friendly_errors, settings
from trainguard.infra.config import component_config
from trainguard.streams.config import WorkerConfig, sink_config

if TYPE_CHECKING:
    from trainguard.streams.metrics import WorkerMetrics

log = logging.getLogger(__name__)


def _web(
    host: str, port: int, metrics: WorkerMetrics, started_at: float, stall_s: float, runner: threading.Thread
) -> ThreadingHTTPServer:
    """/metrics (Prometheus text) and /healthz (503 when the sink stalled with records waiting,
    or its thread ended) on ``host:port``, served from a daemon thread."""
    from prometheus_client import generate_latest

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the http.server protocol's name
            if self.path == "/metrics":
                self._send(200, generate_latest(metrics.registry), "text/plain; version=0.0.4")
            elif self.path == "/healthz":
                doc = metrics.health(stall_s, started_at, runner, agents=False)
                self._send(200 if doc["ok"] else 503, json.dumps(doc).encode(), "application/json")
            else:
                self._send(404, b"not found: /metrics, /healthz\n", "text/plain")

        def _send(self, status: int, payload: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds: quiet
            log.debug(format, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="sink-web", daemon=True).start()
    return server


@click.command("sink")
@click.option(
    "--web-port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="Port for /metrics and /healthz (0: no web server).",
)
@click.option(
    "--app-id",
    default=None,
    help="The workers' app id: the sink's group is <app-id>-sink unless worker.sink.group_id says "
    "otherwise. Overrides worker.app_id.",
)
@click.pass_context
@friendly_errors
def sink(ctx: click.Context, web_port: int, app_id: str | None) -> None:
    """Run the ClickHouse sink as a process of its own, for workers with worker.sink_process: true.

    Stores every registry topic in ClickHouse and dead-letters the garbage on them, as the worker's
    sink thread does; runs until SIGINT/SIGTERM, then stores what it holds and stops.
    """
    from trainguard.infra.sink import SinkThread
    from trainguard.streams.metrics import SinkMetrics, WorkerMetrics

    s = settings(ctx)
    cfg = component_config(s, "worker", WorkerConfig)
    if app_id:
        cfg = replace(cfg, app_id=app_id)
    if cfg.topic_namespace:
        raise click.UsageError(
            f"worker.topic_namespace is {cfg.topic_namespace!r}: a shadow worker's topics are never "
            "stored in ClickHouse (its tables hold the live topics), so there is no sink to run"
        )
    if not cfg.sink_enabled:
        raise click.UsageError(
            "worker.sink_enabled is false: the workers dead-letter garbage themselves and nothing is "
            "stored in ClickHouse; set worker.sink_enabled and worker.sink_process to true to run the "
            "sink as a process of its own"
        )
    sink_cfg = sink_config(cfg)
    metrics = WorkerMetrics()
    runner = SinkThread(s, sink_cfg, SinkMetrics(metrics), cfg.auto_offset_reset)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    started_at = time.time()
    server = (
        _web(cfg.web_host, web_port, metrics, started_at, cfg.liveness_stall_s, runner) if web_port else None
    )
    runner.start()
    click.echo(f"sink up (group {sink_cfg.group_id})", err=True)
    try:
        while not stop.wait(1.0):
            if not runner.is_alive():  # SinkThread rebuilds its sink itself: this is not expected
                raise click.ClickException("the sink's thread ended; see the log above")
    finally:
        runner.stop()
        if server is not None:
            server.shutdown()
    click.echo(f"sink stopped (group {sink_cfg.group_id})", err=True)


#: registered with the worker's commands (``trainguard.commands.worker``).
COMMANDS = [sink]
