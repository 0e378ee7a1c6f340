"""``trainguard postmortem``: an operator's incident timeline and ETTR for a job, from ClickHouse."""

from __future__ import annotations

import json

import click

from trainguard.context import friendly_errors, settings
from trainguard.infra.clickhouse.postmortem import ettr, incidents
from trainguard.infra.clickhouse.store import ClickHouseStore


@click.command()
@click.option("--job", default=None)
@click.option("--incident", "decision_id", default=None, help="One incident (its decision id).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@friendly_errors
def postmortem(ctx: click.Context, job: str | None, decision_id: str | None, as_json: bool) -> None:
    """Incident timeline, detect/decide/recover times, MTTR per category, machines evicted, ETTR."""
    store = ClickHouseStore(settings(ctx).clickhouse)
    incs = incidents(store, job=job, decision_id=decision_id)
    if as_json:
        for i in incs:
            click.echo(json.dumps(i.to_dict()))
        return
    by_cat: dict[str, list[float]] = {}
    evicted: list[str] = []
    for i in incs:
        d = i.to_dict()
        machines = ",".join(i.machines) or "-"
        click.echo(
            f"{i.decision_id[:12]}  {i.job:22} {i.action:9} {i.category:18} machines={machines}  "
            f"detected {d['detected_s']}s  localised {d['localised_s']}s  decided {d['decided_s']}s  "
            f"recovered {d['recovered_s']}s  {i.outcome}"
        )
        if d["recovered_s"] is not None:
            by_cat.setdefault(i.category or i.action, []).append(d["recovered_s"])
        if i.action == "evict":
            evicted += i.machines
    if by_cat:
        click.echo(
            "\nMTTR per category: "
            + ", ".join(f"{c} {sum(v) / len(v):.1f}s (n={len(v)})" for c, v in sorted(by_cat.items()))
        )
    click.echo(f"Machines evicted: {', '.join(sorted(set(evicted))) or 'none'}")
    if job:
        e = ettr(store, job)
        click.echo(
            f"ETTR: {e.ettr:.1%} ({e.productive_s:.0f}s productive of {e.wall_s:.0f}s; "
            f"{e.recomputed_steps} steps recomputed)"
        )


COMMANDS = [postmortem]
