"""``trainguard fr``: analyse a job's PyTorch Flight Recorder dumps.

``trainguard fr analyze DIR --tp N --pp N --dp N --ranks-per-machine N [--json]`` reads the
per-rank dumps in DIR (``<prefix><rank>``, PyTorch's pickle or JSON format, as PyTorch writes them
under ``TORCH_FR_DUMP_TEMP_FILE``) and prints the first collective that did not complete, the
ranks the others wait for, and the parallel group and machines to evict.  A dump's time is its
file's modification time (PyTorch writes it once, at the dump): copy dumps with their times kept
(``cp -p``, ``rsync -t``), or pass ``--dumped-at``.
"""

from __future__ import annotations

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
    load_dump_dir,
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
    help="When the dumps were taken (Unix seconds) instead of the files' modification times.",
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
            dump_ns = {r: int(dumped_at * 1e9) for r in dumps}
        else:
            dump_ns = {r: Path(d.source).stat().st_mtime_ns for r, d in dumps.items()}
        result = analyze_dumps(dumps, topology, dump_ns, config)
    except (FlightRecorderError, ConfigError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(result.to_dict()) if as_json else render(result))


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
