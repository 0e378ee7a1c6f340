"""Operator commands: ``decisions`` (from ClickHouse), ``record`` and ``replay`` (Kafka).

``replay`` writes the shadow topic namespace unless told ``--live``; ``replay --compare`` needs no
broker: it runs a recording through the offline detection path and lists the decisions that differ.
``record``, ``replay`` and ``replay --compare`` show their progress on stderr (``trainguard
--quiet``: none).
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from trainguard.context import friendly_errors, progress, settings
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.progress import Progress, quiet
from trainguard.infra.replay import SHADOW, read_recording
from trainguard.infra.replay import record as record_topics
from trainguard.infra.replay import replay as replay_file
from trainguard.schemas.config import ConfigError
from trainguard.schemas.control import Decision
from trainguard.schemas.topics import BY_NAME, PREFIX, TOPICS, namespaced

if TYPE_CHECKING:  # the detection path is imported only by --compare
    from trainguard.detectors.replay import ReplayConfig


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
@click.option(
    "--namespace",
    default="",
    help="Read the topics' twins in this topic namespace (e.g. shadow: what a shadow worker decided); "
    "the file names them by their registry names.",
)
@click.pass_context
@friendly_errors
def record(ctx: click.Context, topics: str, since_min: float, out_path: str, namespace: str) -> None:
    """Write a time window of topics to a file (JSON lines) for replay."""
    names = (
        [t.name for t in TOPICS] if topics == "all" else [t.strip() for t in topics.split(",") if t.strip()]
    )
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise click.BadParameter(f"unknown topic(s): {', '.join(unknown)}", param_hint="--topics")
    try:
        namespaced(PREFIX, namespace)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--namespace") from None
    since_ms = int((time.time() - since_min * 60) * 1000)
    with open(out_path, "w", encoding="utf-8") as out, progress(ctx, "record") as bar, bar.ticking():
        n = record_topics(settings(ctx).kafka, names, since_ms, out, namespace=namespace, progress=bar)
    click.echo(f"recorded {n} record(s) from {len(names)} topic(s) into {out_path}")


#: what identifies a decision when comparing runs: job, action and target machines (ids, times and
#: reasons carry the run's clock and wording).
DecisionKey = tuple[str, str, tuple[str, ...]]


@dataclass(frozen=True)
class DecisionRow:
    job: str
    action: str
    machines: tuple[str, ...]
    reason: str = ""
    ts_ms: int = 0

    @property
    def key(self) -> DecisionKey:
        return (self.job, self.action, self.machines)

    @classmethod
    def of(cls, d: Decision) -> DecisionRow:
        return cls(d.job, d.action.value, tuple(sorted(d.targets.machines)), d.reason, d.ts_ms)

    def line(self, change: str) -> str:
        when = datetime.fromtimestamp(self.ts_ms / 1000, tz=UTC).isoformat(timespec="milliseconds")
        where = ",".join(self.machines) or "-"
        return (
            f"{change:8} {when if self.ts_ms else '-':29} {self.job:20} {self.action:9} {where:24} "
            f"{self.reason[:100]}"
        ).rstrip()


def _workers(d: Decision) -> bool:
    """A worker's decision (a detection led to it), not an operator's (a code update): only those
    are compared; the others are inputs of the replay, as on the live decisions topic."""
    return bool(d.detection_ids)


def _expected_rows(path: Path) -> list[DecisionRow]:
    """The worker decisions of a recording (its decisions records) or of ``trainguard decisions
    --json`` lines."""
    from trainguard.detectors.replay import decode_records

    rows: list[DecisionRow] = []
    with open(path, encoding="utf-8") as fh:
        for n, text in enumerate(fh, 1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
                if not isinstance(obj, dict):
                    raise ValueError("not a JSON object")
                if "topic" in obj:  # a recording line
                    events, rejected = decode_records([obj])
                    if rejected:
                        raise ValueError(rejected[0])
                    rows += [DecisionRow.of(e) for _, e in events if isinstance(e, Decision) and _workers(e)]
                elif obj.get("detection_ids", ["?"]):  # `decisions --json`; without ids: a worker's
                    targets = obj.get("targets") or {}
                    created = obj.get("created_at")
                    rows.append(
                        DecisionRow(
                            str(obj["job"]),
                            str(obj["action"]),
                            tuple(sorted(targets.get("machines", []))),
                            str(obj.get("reason", "")),
                            int(datetime.fromisoformat(created).timestamp() * 1000) if created else 0,
                        )
                    )
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise click.ClickException(f"{path}:{n}: not a decision or recording line ({exc})") from None
    return rows


def _replay_config(ctx: click.Context, config_path: str | None) -> ReplayConfig:
    """The detector settings to evaluate: ``config_path`` (a config file's ``worker`` section, or a
    bare worker section), else the worker settings of trainguard's own config."""
    from trainguard.detectors.replay import ReplayConfig
    from trainguard.infra.config import COMPONENT_SECTIONS, component_config
    from trainguard.schemas.config import load_yaml_file
    from trainguard.streams.config import WorkerConfig

    if config_path is None:
        cfg = component_config(settings(ctx), "worker", WorkerConfig)
        return ReplayConfig(**{f.name: getattr(cfg, f.name) for f in fields(ReplayConfig)})
    data = load_yaml_file(config_path)
    if "worker" in data:
        section = data["worker"] or {}
    elif set(data) & {"kafka", "clickhouse", "stack", *COMPONENT_SECTIONS}:
        section = {}  # a config file without a worker section: the defaults
    else:
        section = data
    if not isinstance(section, dict):
        raise ConfigError(f"{config_path}: worker: expected a mapping")
    return ReplayConfig.from_worker_section(section)


def compare_decisions(
    recording: Path,
    config: ReplayConfig,
    expected: Path | None = None,
    prior: Path | None = None,
    progress: Progress | None = None,
) -> tuple[list[DecisionRow], list[DecisionRow], int, int]:
    """Replay ``recording`` offline with ``config``; (added, removed, expected count, replayed count).

    Expected: the worker decisions recorded in ``recording``, or those of ``expected``.  Recorded
    worker decisions are not replayed (the replay makes its own); ``prior``: a recording of the
    decisions made before ``recording`` starts (de-duplication and capture cooldown state).
    ``progress``: the records read, then the replay's phase (the detection path has no count).
    """
    from trainguard.detectors.replay import decode_records, replay_events

    bar = progress or quiet()
    bar.phase(f"reading {recording.name}", unit="records")
    events, rejected = decode_records(bar.iter(read_recording(recording)))
    for reason in rejected:
        bar.echo(f"skipped (as the workers would): {reason}", file=sys.stderr)
    recorded = [e for _, e in events if isinstance(e, Decision) and _workers(e)]
    inputs = [(ts, e) for ts, e in events if not (isinstance(e, Decision) and _workers(e))]
    before: list[Decision] = []
    if prior is not None:
        before = [e for _, e in decode_records(read_recording(prior))[0] if isinstance(e, Decision)]
    bar.phase(f"running {len(inputs):,} events through the detection path")
    result = replay_events(inputs, config, prior=before)
    want = _expected_rows(expected) if expected is not None else [DecisionRow.of(d) for d in recorded]
    got = [DecisionRow.of(d) for d in result.decisions]
    missing = Counter(r.key for r in want) - Counter(r.key for r in got)
    extra = Counter(r.key for r in got) - Counter(r.key for r in want)

    def pick(rows: list[DecisionRow], keys: Counter[DecisionKey]) -> list[DecisionRow]:
        out = []
        for r in rows:
            if keys[r.key] > 0:
                keys[r.key] -= 1
                out.append(r)
        return out

    return pick(got, extra), pick(want, missing), len(want), len(got)


@click.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--speed",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Time scale: 2 plays twice as fast, 0 as fast as possible.",
)
@click.option(
    "--namespace",
    default=SHADOW,
    show_default=True,
    help="Topic namespace written to (trainguard.<namespace>.*, created if needed): read only by "
    "`trainguard worker --namespace <namespace>`, never by the live workers or the action service.",
)
@click.option(
    "--live",
    is_flag=True,
    help="Write to the LIVE topics, as recorded: the live workers decide on the records and the "
    "action service acts on those decisions (evicts machines, restarts jobs).",
)
@click.option(
    "--compare",
    is_flag=True,
    help="No Kafka: run FILE through the offline detection path with the worker settings of "
    "--config and print the decisions that differ from the expected ones (added / removed). "
    "Exit code 0 when none differ, 1 when some do.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="With --compare: YAML with the worker settings to evaluate, a config file (its worker "
    "section) or a bare worker section.  Default: the worker settings of trainguard's config.",
)
@click.option(
    "--expected",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="With --compare: the decisions to compare with, JSON lines: a recording (its decisions "
    "records) or `trainguard decisions --json` output.  Default: the decisions recorded in FILE.",
)
@click.option(
    "--prior",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="With --compare: a recording of the decisions made before FILE begins (de-duplication "
    "and capture cooldown start from them).",
)
@click.pass_context
@friendly_errors
def replay(
    ctx: click.Context,
    file: str,
    speed: float,
    namespace: str,
    live: bool,
    compare: bool,
    config_path: str | None,
    expected: str | None,
    prior: str | None,
) -> None:
    """Play a recording back into Kafka, keeping keys, order and relative timing.

    By default into the shadow topics (trainguard.shadow.*), where no live worker or action
    service acts on it; `trainguard worker --namespace shadow` runs the detection path there.
    --live writes to the live topics.  --compare replays FILE offline instead and reports how the
    decisions of the given worker settings differ from the recorded ones: exit code 0 when none
    differ, 1 when some do (2: an error).
    """
    if compare:
        if live:
            raise click.BadParameter("--compare writes nothing to Kafka", param_hint="--live")
        cfg = _replay_config(ctx, config_path)
        # No final line: the comparison's own lines follow (on a terminal the line goes away; in a
        # log, a run that took one interval or more leaves its phases' lines).
        with progress(ctx, "replay --compare", summary=False) as bar, bar.ticking():
            added, removed, n_want, n_got = compare_decisions(
                Path(file), cfg, Path(expected) if expected else None, Path(prior) if prior else None, bar
            )
        for row in sorted(added + removed, key=lambda r: (r.job, r.ts_ms)):
            click.echo(row.line("added" if row in added else "removed"))
        differ = len(added) + len(removed)
        click.echo(
            f"{differ} decision(s) differ: {len(added)} added, {len(removed)} removed "
            f"({n_want} expected, {n_got} replayed)"
            if differ
            else f"no difference ({n_want} expected, {n_got} replayed)"
        )
        ctx.exit(1 if differ else 0)
    for opt, value in (("--config", config_path), ("--expected", expected), ("--prior", prior)):
        if value is not None:
            raise click.BadParameter("only with --compare", param_hint=opt)
    if live:
        click.secho(
            "WARNING: replaying into the LIVE topics: the live workers and the action service will act "
            "on these records (evict machines, restart jobs).",
            fg="red",
            err=True,
        )
        with progress(ctx, "replay") as bar, bar.ticking():
            n = replay_file(settings(ctx).kafka, Path(file), speed=speed, progress=bar)
        click.echo(f"replayed {n} record(s) into the live topics", file=sys.stdout)
        return
    try:
        namespaced(PREFIX, namespace)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--namespace") from None
    if not namespace:
        raise click.BadParameter("empty: use --live for the live topics", param_hint="--namespace")
    with progress(ctx, "replay") as bar, bar.ticking():
        n = replay_file(settings(ctx).kafka, Path(file), speed=speed, namespace=namespace, progress=bar)
    click.echo(f"replayed {n} record(s) into {namespaced(PREFIX, namespace)}*", file=sys.stdout)


COMMANDS = [decisions, record, replay]


@click.command("set-threshold")
@click.argument("path")
@click.argument("value")
@click.option("--app-id", default="", help="Only workers of this app id (default: every worker).")
@click.option(
    "--namespace",
    default="",
    help="The workers of this topic namespace (e.g. shadow) instead of the live ones.",
)
@click.pass_context
@friendly_errors
def set_threshold(ctx: click.Context, path: str, value: str, app_id: str, namespace: str) -> None:
    """Change a worker setting at runtime, e.g. `set-threshold monitor.stall.stall_s 300`.

    Every worker applies it without a restart (and workers started later too); the value is
    parsed as YAML (numbers, booleans) and validated by each worker against its config.
    """
    import uuid

    import yaml

    from trainguard.infra.bus import EventProducer, signer_for
    from trainguard.schemas.base import now_ms
    from trainguard.schemas.control import Command, CommandKind
    from trainguard.schemas.topics import CONTROL
    from trainguard.streams.agents.control import apply_change
    from trainguard.streams.config import WorkerConfig

    parsed = yaml.safe_load(value)
    apply_change(WorkerConfig(), path, parsed)  # reject a bad path or value here, before publishing
    cmd = Command(
        command_id=uuid.uuid4().hex,
        ts_ms=now_ms(),
        kind=CommandKind.SET_THRESHOLD,
        args={"path": path, "value": parsed, **({"app_id": app_id} if app_id else {})},
    )
    try:
        topic = replace(CONTROL, name=namespaced(CONTROL.name, namespace))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--namespace") from None
    s = settings(ctx)
    producer = EventProducer(s.kafka, signer=signer_for(s, "operator"))
    producer.send(cmd, topic)
    producer.flush()
    producer.close()
    click.echo(f"published {path} = {parsed!r} to {topic.name}")


COMMANDS.append(set_threshold)
