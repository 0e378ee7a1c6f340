"""``trainguard demo``, ``trainguard inject`` and ``trainguard postmortem``."""

from __future__ import annotations

import json
from pathlib import Path

import click
import yaml

from infra.clickhouse.postmortem import ettr, incidents
from infra.clickhouse.store import ClickHouseStore
from trainguard.context import friendly_errors, settings


@click.command()
@click.option(
    "--scenario",
    "scenario_file",
    type=click.Path(exists=True, dir_okay=False),
    help="YAML list of {fault, machine} (machine: index or name); default: one of each kind.",
)
@click.option("--summary-json", type=click.Path(dir_okay=False), help="Also write the result as JSON.")
@click.option("--keep", is_flag=True, help="Leave the cluster, worker and action service running.")
@click.option(
    "--baseline/--no-baseline",
    default=True,
    show_default=True,
    help="Run the same scenario on a second job under the baseline policy (timeout + cold requeue).",
)
@click.pass_context
@friendly_errors
def demo(
    ctx: click.Context, scenario_file: str | None, summary_json: str | None, keep: bool, baseline: bool
) -> None:
    """Run a real PyTorch job on a local cluster through injected faults; print timeline and ETTR."""
    from trainguard.demo.run import DEFAULT_SCENARIO, Demo, DemoConfig, print_timeline

    scenario = DEFAULT_SCENARIO
    if scenario_file:
        scenario = yaml.safe_load(Path(scenario_file).read_text())
        if not isinstance(scenario, list) or not all(isinstance(i, dict) and "fault" in i for i in scenario):
            raise click.BadParameter(
                "a scenario is a list of {fault, machine} mappings", param_hint="--scenario"
            )
    import signal

    d = Demo(settings(ctx), DemoConfig(baseline=baseline), scenario)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # run the cleanup below on SIGTERM too, not only on Ctrl-C

    signal.signal(signal.SIGTERM, on_term)
    try:
        summary = d.run()
    finally:
        if not keep:
            d.stop()
    print_timeline(summary)
    if summary_json:
        Path(summary_json).write_text(json.dumps(summary, indent=2))


@click.command()
@click.option("--job", required=True)
@click.option("--machine", required=True, help="Machine name (m0, standby-1, ...).")
@click.option(
    "--fault",
    required=True,
    help="xid, nic-down, nic-flap, gpu-lost, hang, hang-dataloader, "
    "hang-checkpoint, slow, nan, crash, user-error, oom",
)
@click.option("--xid", default=79, show_default=True, help="Xid code for --fault xid.")
@click.option(
    "--cluster-dir", type=click.Path(file_okay=False), help="Default: the latest demo run's cluster."
)
@click.pass_context
@friendly_errors
def inject(ctx: click.Context, job: str, machine: str, fault: str, xid: int, cluster_dir: str | None) -> None:
    """Inject a fault into a machine of the demo cluster."""
    from trainguard.demo.inject import inject as do_inject

    if cluster_dir is None:
        runs = sorted((settings(ctx).stack.home_path / "demo").glob("*/cluster"))
        if not runs:
            raise click.ClickException("no demo cluster found; pass --cluster-dir")
        cluster_dir = str(runs[-1])
    try:
        click.echo(do_inject(Path(cluster_dir), machine, fault, job=job, xid=xid, settings=settings(ctx)))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--fault") from exc


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


COMMANDS = [demo, inject, postmortem]
