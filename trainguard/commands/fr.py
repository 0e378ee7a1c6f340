"""``trainguard fr``: analyse a job's PyTorch Flight Recorder dumps.

``trainguard fr analyze DIR --tp N --pp N --dp N --ranks-per-machine N [--json]`` reads the
per-rank dumps in DIR (``<prefix><rank>``, PyTorch's pickle or JSON format, as PyTorch writes them
under ``TORCH_FR_DUMP_TEMP_FILE``) and prints the first collective that did not complete, the
ranks the others wait for, and the parallel group and machines to evict.  When the dumps were
taken is read from the dumps themselves (their newest entry's time, PyTorch's ``time_created_ns``
and ``time_discovered_*_ns``), never from the files' modification times, which a copy changes.
That time is a lower bound, so without ``--dumped-at`` every collective entered and not completed
counts as stuck, as PyTorch's ``fr_trace`` judges a timeout dump; ``--dumped-at`` (Unix seconds)
measures waits against a known dump time and applies ``min_stuck_s``.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import click

from trainguard.commands.topology_options import JobShape, topology_options
from trainguard.detectors.eviction import describe
from trainguard.detectors.flight_recorder import (
    FlightRecorderConfig,
    FlightRecorderError,
    FlightRecorderResult,
    analyze_dumps,
    dump_time_ns,
    load_dump_dir,
    untimed_config,
)
from trainguard.schemas.config import ConfigError, load_config, load_yaml_file

ENV_PREFIX = "TRAINGUARD_FR"


@click.group("fr")
def fr() -> None:
    """PyTorch Flight Recorder analysis: which collective a job is stuck in, and on whom."""


@fr.command("analyze")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@topology_options
@click.option("--prefix", help="File name prefix before the rank (default: inferred).")
@click.option(
    "--dumped-at",
    type=float,
    help="When the dumps were taken (Unix seconds); default: the dumps' newest entry time.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help=f"YAML file of FlightRecorderConfig settings (env overrides: {ENV_PREFIX}__<SETTING>).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def analyze(
    directory: Path,
    shape: JobShape,
    prefix: str | None,
    dumped_at: float | None,
    config_path: Path | None,
    as_json: bool,
) -> None:
    """Analyse the Flight Recorder dumps in DIRECTORY and name the parallel group to evict."""
    try:
        config = load_config(
            FlightRecorderConfig, load_yaml_file(config_path) if config_path else {}, env_prefix=ENV_PREFIX
        )
        topology = shape.topology(directory.name)
        dumps = load_dump_dir(directory, prefix)
        if dumped_at is not None:
            when, timed_by = int(dumped_at * 1e9), "--dumped-at"
        else:
            newest = dump_time_ns(dumps)
            if newest is None:
                raise click.ClickException(f"{directory}: no entry in the dumps has a time: pass --dumped-at")
            when, timed_by, config = newest, "newest entry", untimed_config(config)
        result = analyze_dumps(dumps, topology, {r: when for r in dumps}, config)
    except (FlightRecorderError, ConfigError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        out = result.to_dict()
        out["evidence"]["dump_time"] = {"ns": when, "from": timed_by}
        click.echo(json.dumps(out))
    else:
        stamp = dt.datetime.fromtimestamp(when / 1e9, dt.UTC).isoformat(timespec="milliseconds")
        lower = " (a lower bound: waits are at least what is shown)" if timed_by != "--dumped-at" else ""
        click.echo(f"{render(result)}\ndump time: {stamp}, from the {timed_by}{lower}")


def render(result: FlightRecorderResult) -> str:
    lines = [f"verdict: {result.verdict}", f"suspect ranks: {list(result.suspect_ranks)}"]
    lines.append(f"evict: {describe(result.evict_kind, result.evict_ranks, result.evict_machines)}")
    if result.evict_why:
        lines.append(f"not evicted: {result.evict_why}")
    lines.append(f"reason: {result.reason}")
    if result.undumped_ranks:
        lines.append(f"ranks without a dump: {list(result.undumped_ranks)}")
    for s in result.stuck:
        lines.append(
            f"stuck: {s.op} #{s.seq} in {s.desc or s.group} entered by {list(s.entered)}, "
            f"missing {list(s.missing)}, waited {s.waited_s:.1f}s"
        )
    for g in result.groups:
        spread = sorted(set(g.last_completed.values()))
        lines.append(f"group {g.desc or g.name} {list(g.ranks)}: last completed #{spread[0]}..#{spread[-1]}"
                     if spread else f"group {g.desc or g.name} {list(g.ranks)}: no collectives")  # fmt: skip
    return "\n".join(lines)


COMMANDS: list[click.Command] = [fr]
