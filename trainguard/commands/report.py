"""``trainguard report``: a job's postmortem as one self-contained HTML file (plots inlined: it
opens on an air-gapped cluster), from ClickHouse through the named queries."""

from __future__ import annotations

from pathlib import Path

import click

from trainguard.commands.sql import since_ms
from trainguard.context import friendly_errors, settings
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.report import data as report_data
from trainguard.infra.report.render import render


def write_report(store: ClickHouseStore, job: str, out: Path, *, since: int = 0, baseline: str | None = None,
                 quiet: bool = False) -> Path:  # fmt: skip
    """Read, render and write the report of ``job`` to ``out``; its path."""

    def say(msg: str) -> None:
        if not quiet:
            click.echo(f"report: reading {msg}", err=True)

    data = report_data.load(store, job, since_ms=since, baseline=baseline, progress=say)
    if not data.ok:
        raise click.ClickException(f"no training steps and no decisions for job {job!r} in ClickHouse")
    say("done; rendering")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render(data), encoding="utf-8")
    tmp.replace(out)  # a reader never sees half a report
    return out


@click.command()
@click.option("--job", required=True, help="The job.")
@click.option("--since", default=None, help="Only from then: a duration ago (30m, 6h, 2d) or an ISO time.")
@click.option(
    "--baseline", default=None, help="Another job to compare ETTR with (e.g. the same run unguarded)."
)
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The HTML file [report-<job>.html].")  # fmt: skip
@click.option("--quiet", is_flag=True, help="No progress on stderr.")
@click.pass_context
@friendly_errors
def report(
    ctx: click.Context, job: str, since: str | None, baseline: str | None, out: Path | None, quiet: bool
) -> None:
    """Write a job's postmortem report (training curve with incidents, ETTR over time, incidents,
    MTTR, evictions, standbys, decisions with evidence) as one HTML file, and print its path."""
    store = ClickHouseStore(settings(ctx).clickhouse)
    try:
        path = write_report(
            store,
            job,
            out or Path(f"report-{job}.html"),
            since=since_ms(since) if since else 0,
            baseline=baseline,
            quiet=quiet,
        )
    finally:
        store.close()
    click.echo(str(path))


COMMANDS = [report]
