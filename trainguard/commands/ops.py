"""Operator commands: ``decisions`` (from ClickHouse), ``record`` and ``replay`` (Kafka)."""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from infra.clickhouse.store import ClickHouseStore
from infra.replay import record as record_topics
from infra.replay import replay as replay_file
from schemas.topics import BY_NAME, TOPICS
from trainguard.context import friendly_errors, settings


@click.command()
@click.option("--job", default=None, help="Only this job.")
@click.option(
    "--since", "since_min", type=click.FloatRange(min=0), default=None, help="Only the last N minutes."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_context
@friendly_errors
def decisions(ctx: click.Context, job: str | None, since_min: float | None, as_json: bool) -> None:
    """List decisions with their evidence, newest last."""
    store = ClickHouseStore(settings(ctx).clickhouse)
    where: list[str] = ["1"]
    params: dict[str, Any] = {}
    if job:
        where.append("job = %(job)s")
        params["job"] = job
    if since_min is not None:
        where.append("ts_ms >= %(since)s")
        params["since"] = int((time.time() - since_min * 60) * 1000)
    rows = store.query_dicts(
        "SELECT decision_id, job, action, machines, ranks, group_kind, reason, detection_ids, evidence, "
        f"ts_ms FROM decisions FINAL WHERE {' AND '.join(where)} ORDER BY ts_ms, decision_id",
        params,
    )
    for r in rows:
        created = datetime.fromtimestamp(r["ts_ms"] / 1000, tz=UTC).isoformat(timespec="milliseconds")
        targets = {"machines": list(r["machines"]), "ranks": list(r["ranks"]), "group_kind": r["group_kind"]}
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "decision_id": r["decision_id"],
                        "job": r["job"],
                        "action": r["action"],
                        "targets": targets,
                        "reason": r["reason"],
                        "created_at": created,
                        "detection_ids": list(r["detection_ids"]),
                        "evidence": json.loads(r["evidence"] or "{}"),
                    }
                )
            )
        else:
            where_ = ",".join(targets["machines"]) or "-"
            click.echo(f"{created}  {r['job']:20} {r['action']:9} {where_:24} {r['reason'][:100]}")
    if not as_json:
        click.echo(f"{len(rows)} decision(s)", err=True)


@click.command()
@click.option("--topics", default="all", show_default=True, help="Comma-separated topic names, or 'all'.")
@click.option(
    "--since",
    "since_min",
    type=click.FloatRange(min=0),
    default=60,
    show_default=True,
    help="Start of the window, minutes ago.",
)
@click.option("--out", "out_path", type=click.Path(dir_okay=False, writable=True), required=True)
@click.pass_context
@friendly_errors
def record(ctx: click.Context, topics: str, since_min: float, out_path: str) -> None:
    """Write a time window of topics to a file (JSON lines) for replay."""
    names = (
        [t.name for t in TOPICS] if topics == "all" else [t.strip() for t in topics.split(",") if t.strip()]
    )
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise click.BadParameter(f"unknown topic(s): {', '.join(unknown)}", param_hint="--topics")
    since_ms = int((time.time() - since_min * 60) * 1000)
    with open(out_path, "w", encoding="utf-8") as out:
        n = record_topics(settings(ctx).kafka, names, since_ms, out)
    click.echo(f"recorded {n} record(s) from {len(names)} topic(s) into {out_path}")


@click.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--speed",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Time scale: 2 plays twice as fast, 0 as fast as possible.",
)
@click.pass_context
@friendly_errors
def replay(ctx: click.Context, file: str, speed: float) -> None:
    """Play a recording back into Kafka, keeping keys, order and relative timing."""
    n = replay_file(settings(ctx).kafka, Path(file), speed=speed)
    click.echo(f"replayed {n} record(s)", file=sys.stdout)


COMMANDS = [decisions, record, replay]


@click.command("set-threshold")
@click.argument("path")
@click.argument("value")
@click.option("--app-id", default="", help="Only workers of this app id (default: every worker).")
@click.pass_context
@friendly_errors
def set_threshold(ctx: click.Context, path: str, value: str, app_id: str) -> None:
    """Change a worker setting at runtime, e.g. `set-threshold monitor.stall.stall_s 300`.

    Every worker applies it without a restart (and workers started later too); the value is
    parsed as YAML (numbers, booleans) and validated by each worker against its config.
    """
    import uuid

    import yaml

    from infra.bus import EventProducer
    from schemas.base import now_ms
    from schemas.control import Command, CommandKind
    from schemas.topics import CONTROL
    from streams.agents.control import apply_change
    from streams.config import WorkerConfig

    parsed = yaml.safe_load(value)
    apply_change(WorkerConfig(), path, parsed)  # reject a bad path or value here, before publishing
    cmd = Command(
        command_id=uuid.uuid4().hex,
        ts_ms=now_ms(),
        kind=CommandKind.SET_THRESHOLD,
        args={"path": path, "value": parsed, **({"app_id": app_id} if app_id else {})},
    )
    producer = EventProducer(settings(ctx).kafka)
    producer.send(cmd, CONTROL)
    producer.flush()
    producer.close()
    click.echo(f"published {path} = {parsed!r} to {CONTROL.name}")


COMMANDS.append(set_threshold)
