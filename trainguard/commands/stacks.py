"""``trainguard stacks``: run the over-eviction analysis on a directory of py-spy dumps.

``trainguard stacks analyze DIR --tp N --pp N --dp N --ranks-per-machine N [--json]`` reads
``DIR/rank<R>_pid<P>.txt|json`` and ``rank<R>_worker<K>_pid<P>.txt|json`` (or ``round<N>/``
folders of them), and prints the verdict, the suspects and the group and machines to evict.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from trainguard.commands.topology_options import JobShape, topology_options
from trainguard.detectors.eviction import describe
from trainguard.detectors.stacks import (
    OverEvictionClassifier,
    OverEvictionConfig,
    StackParseError,
    load_dump_dir,
)
from trainguard.detectors.stacks.classifier import MODES
from trainguard.detectors.stacks.result import OverEvictionResult
from trainguard.schemas.config import ConfigError, load_config, load_yaml_file

ENV_PREFIX = "TRAINGUARD_STACKS"


@click.group("stacks")
def stacks() -> None:
    """Stack-trace aggregation and over-eviction (ByteRobust §5)."""


@stacks.command("analyze")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@topology_options
@click.option(
    "--mode",
    type=click.Choice(MODES),
    default="auto",
    show_default=True,
    help="auto: one round or frozen stacks are a hang, moving stacks are voted on as fail-slow.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help=f"YAML file of OverEvictionConfig settings (env overrides: {ENV_PREFIX}__<SETTING>).",
)
@click.option(
    "--straggler-ranks",
    default="",
    metavar="R[,R...]",
    help="Ranks the straggler signal that asked for the capture named: a fail-slow vote for one of "
    "them is tested against chance alone, not against every rank of the job.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def analyze(
    directory: Path,
    shape: JobShape,
    mode: str,
    config_path: Path | None,
    straggler_ranks: str,
    as_json: bool,
) -> None:
    """Analyse the stack dumps in DIRECTORY and name the parallel group to evict.

    A rank with no main-process dump counts as a candidate root (its process is gone or
    could not be traced): if the rest of the job waits on it, it is the suspect.  A fail-slow
    vote too close to call says how many more rounds would decide it.
    """
    try:
        hint = [int(r) for r in straggler_ranks.split(",") if r.strip()]
    except ValueError:
        raise click.ClickException(
            f"--straggler-ranks {straggler_ranks!r}: expected ranks like 3,7"
        ) from None
    try:
        config = load_config(
            OverEvictionConfig, load_yaml_file(config_path) if config_path else {}, env_prefix=ENV_PREFIX
        )
        topology = shape.topology(directory.name)
        rounds = load_dump_dir(directory, prefer=config.prefer_format)
        result = OverEvictionClassifier(topology, config).analyze(rounds, mode=mode, hint=hint)
    except (StackParseError, ConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(result.to_dict()))
    else:
        click.echo(_render(result))


def _render(result: OverEvictionResult) -> str:
    ev = result.evidence
    lines = [f"verdict: {result.verdict.value}", f"suspect ranks: {list(result.suspect_ranks)}"]
    lines.append(f"evict: {describe(result.evict_kind, result.evict_ranks, result.evict_machines)}")
    if result.evict_why:
        lines.append(f"not evicted: {result.evict_why}")
    lines.append(f"reason: {ev.reason}")
    if ev.more_rounds:
        lines.append(f"undecided: capture {ev.more_rounds} more round(s) and analyse them all again")
    if ev.missing_ranks:
        lines.append(f"missing ranks (no dump): {list(ev.missing_ranks)}")
    for v in ev.votes:
        lines.append(f"vote: {v.kind} group {list(v.ranks)} flagged in {v.rounds} round(s)")
    lines.append(f"stack classes ({ev.analysis} analysis, {ev.rounds} round(s)):")
    for c in ev.classes:
        mark = "*" if c.suspect else " "
        state = "" if c.busy is None else (" busy" if c.busy else " idle")
        ranks: list[object] = list(c.ranks) if len(c.ranks) <= 12 else [*c.ranks[:12], "..."]
        top = c.frames[0] if c.frames else "-"
        lines.append(f" {mark} {c.process:<10} {c.role + state:<16} {len(c.ranks):>6} ranks {ranks}  {top}")
    return "\n".join(lines)


COMMANDS: list[click.Command] = [stacks]
