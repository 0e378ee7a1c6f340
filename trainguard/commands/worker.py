"""``trainguard worker``: run one stream worker (Faust) in the foreground."""

from __future__ import annotations

from typing import Any

import click

from trainguard.commands.sink import COMMANDS as SINK_COMMANDS
from trainguard.context import friendly_errors, settings
from trainguard.infra.config import component_config
from trainguard.streams.config import WorkerConfig


@click.command()
@click.option(
    "--web-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Port for /metrics and /healthz (0: no web server). Overrides worker.web_port.",
)
@click.option(
    "--app-id", default=None, help="Consumer group / app id (workers with one id share partitions)."
)
@click.option(
    "--namespace",
    default=None,
    help="Topic namespace, e.g. shadow (where `trainguard replay` writes by default): read and write "
    "trainguard.<namespace>.* instead of the live topics, creating them if needed; no ClickHouse sink, "
    "app id <app-id>-<namespace>. Overrides worker.topic_namespace.",
)
@click.option("--loglevel", type=click.Choice(["debug", "info", "warning", "error"]), default="info")
@click.pass_context
@friendly_errors
def worker(
    ctx: click.Context, web_port: int | None, app_id: str | None, namespace: str | None, loglevel: str
) -> None:
    """Run a stream worker: detections, decisions and the ClickHouse sink (in a thread; with
    worker.sink_process: true, none: run `trainguard sink` beside the workers).

    With a topic namespace (--namespace shadow) it is a shadow worker: the whole detection path on
    the replayed stream, its decisions on trainguard.<namespace>.control.decisions, which no
    action service reads; nothing is written to ClickHouse.
    """
    from dataclasses import replace

    import faust

    from trainguard.streams.app import build_app

    s = settings(ctx)
    cfg = component_config(s, "worker", WorkerConfig)
    if namespace is not None:
        try:
            cfg = replace(cfg, topic_namespace=namespace)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--namespace") from None
    if web_port is not None:
        cfg = replace(cfg, web_port=web_port)
    if app_id:
        cfg = replace(cfg, app_id=app_id)
    if cfg.topic_namespace:
        from trainguard.infra.bus import create_topics

        create_topics(s.kafka, namespace=cfg.topic_namespace)  # Faust must not auto-create them
        click.echo(
            f"shadow worker {cfg.app_id}: topics trainguard.{cfg.topic_namespace}.*, no ClickHouse sink",
            err=True,
        )
    if cfg.state_enabled:
        _create_changelogs(s, cfg)
    built = build_app(s, cfg)
    faust.Worker(built.app, loglevel=loglevel, quiet=True, redirect_stdouts=False).execute_from_commandline()


def _create_changelogs(s: Any, cfg: WorkerConfig) -> None:
    """The state tables' changelog topics (Faust is not allowed to create topics); waits for the
    broker like the worker itself would, saying so."""
    import time

    from trainguard.infra.backoff import Backoff
    from trainguard.infra.bus import BusError, create_topics
    from trainguard.streams.state import changelog_topics

    backoff = Backoff(initial_s=1.0, max_s=30.0)
    while True:
        try:
            create_topics(s.kafka, changelog_topics(cfg.app_id, s.kafka))
            return
        except BusError as exc:
            delay = backoff.next_delay()
            click.echo(f"worker state topics: {exc}; retrying in {delay:.0f}s", err=True)
            time.sleep(delay)


#: the sink is the worker's: ``trainguard sink`` runs it as a process of its own.
COMMANDS = [worker, *SINK_COMMANDS]
