"""``trainguard postmortem``: an operator's incident timeline and ETTR for a job, from ClickHouse.

Times are seconds from the fault's first sign; *recovered* is the job's first training step after
the recovery, and *procedure* the recovery procedure alone (the decision to its end), shown apart
(:mod:`trainguard.infra.clickhouse.postmortem`)."""

from __future__ import annotations

import json

import click

from trainguard.context import friendly_errors, settings
from trainguard.infra.clickhouse.postmortem import ettr, incidents
from trainguard.infra.clickhouse.store import ClickHouseStore


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds}s"


@click.command()
@click.option("--job", default=None)
@click.option("--incident", "decision_id", default=None, help="One incident (its decision id).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@friendly_errors
def postmortem(ctx: click.Context, job: str | None, decision_id: str | None, as_json: bool) -> None:
    """Incident timeline, detect/decide/recover times, MTTR per category, machines evicted, ETTR.

    recovered: the fault to the job's first training step after its recovery; procedure: the
    recovery procedure alone (the decision to its end)."""
    store = ClickHouseStore(settings(ctx).clickhouse)
    incs = incidents(store, job=job, decision_id=decision_id)
    if as_json:
        for i in incs:
            click.echo(json.dumps(i.to_dict()))
        return
    # per category: (recovered s, procedure s) of the incidents training again
    by_cat: dict[str, list[tuple[float, float]]] = {}
    evicted: list[str] = []
    for i in incs:
        d = i.to_dict()
        machines = ",".join(i.machines) or "-"
        click.echo(
            f"{i.decision_id[:12]}  {i.job:22} {i.action:9} {i.category:18} machines={machines}  "
            f"detected {_s(d['detected_s'])}  localised {_s(d['localised_s'])}  "
            f"decided {_s(d['decided_s'])}  recovered {_s(d['recovered_s'])}  "
            f"(procedure {_s(d['procedure_s'])})  {i.outcome}"
        )
        if d["recovered_s"] is not None:
            by_cat.setdefault(i.category or i.action, []).append((d["recovered_s"], d["procedure_s"] or 0.0))
        if i.action == "evict":
            evicted += i.machines
    if by_cat:
        click.echo(
            "\nMTTR per category: "
            + ", ".join(
                f"{c} {sum(r for r, _ in v) / len(v):.1f}s (n={len(v)}; "
                f"procedure {sum(p for _, p in v) / len(v):.2f}s)"
                for c, v in sorted(by_cat.items())
            )
        )
    click.echo(f"Machines evicted: {', '.join(sorted(set(evicted))) or 'none'}")
    if job:
        e = ettr(store, job)
        click.echo(
            f"ETTR: {e.ettr:.1%} ({e.productive_s:.0f}s productive of {e.wall_s:.0f}s; "
            f"{e.recomputed_steps} steps recomputed)"
        )


COMMANDS = [postmortem]
