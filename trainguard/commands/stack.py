"""``trainguard stack ...``, ``trainguard migrate`` and ``trainguard store prune``."""

from __future__ import annotations

import json

import click

from trainguard.context import friendly_errors, progress, settings
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.config import Settings, home_note, home_origin, load_settings
from trainguard.infra.stack.manager import Stack

CLUSTER_ENV = "TRAINGUARD__STACK__CLUSTER"


def _settings(ctx: click.Context, cluster: bool) -> Settings:
    """The command's settings; ``cluster``: as if ``stack.cluster`` were true (the cluster's endpoints)."""
    s = settings(ctx)
    if cluster and not s.stack.cluster:
        s = load_settings(ctx.obj.get("config_path"), environ={**s.environ, CLUSTER_ENV: "true"})
        ctx.obj["settings"] = s
    return s


_CLUSTER_OPTION = click.option(
    "--cluster",
    is_flag=True,
    help="The local cluster instead of the one-node stack: 3 Kafka brokers (KRaft, 3 controller "
    "voters), 2 ClickHouse replicas and ZooKeeper (what stack.cluster: true selects).",
)


@click.group()
def stack() -> None:
    """Start, stop and inspect the embedded Kafka + ClickHouse stack (optional: local Slurm, Kubernetes)."""


@stack.command()
@click.option(
    "--slurm", is_flag=True, help="Also start a private local Slurm cluster (munged, slurmctld, slurmd)."
)
@click.option(
    "--slurm-nodes",
    type=click.IntRange(1, 64),
    default=None,
    help="Number of Slurm nodes n1..nN (default: stack.slurm_nodes, 6).",
)
@click.option(
    "--k8s",
    is_flag=True,
    help="Also start a private Kubernetes control plane (etcd, kube-apiserver, scheduler, "
    "controller-manager, kwok nodes; built from Go modules the first time).",
)
@click.option(
    "--k8s-nodes",
    type=click.IntRange(1, 500),
    default=None,
    help="Number of Kubernetes nodes n1..nN (default: stack.k8s_nodes, 12).",
)
@_CLUSTER_OPTION
@click.pass_context
@friendly_errors
def up(
    ctx: click.Context, slurm: bool, slurm_nodes: int | None, k8s: bool, k8s_nodes: int | None, cluster: bool
) -> None:
    """Start Kafka (KRaft) and ClickHouse, create topics, apply migrations (idempotent).

    Shows on stderr what runs now and for how long (Maven's downloads on a first start, the
    Kubernetes build); `trainguard --quiet` or TRAINGUARD_PROGRESS=0: nothing.
    """
    if slurm_nodes is not None and not slurm:
        raise click.UsageError("--slurm-nodes needs --slurm")
    if k8s_nodes is not None and not k8s:
        raise click.UsageError("--k8s-nodes needs --k8s")
    s = _settings(ctx, cluster)
    st = Stack(s)
    # The summary below says how long it took: the progress line only leaves its slow phases.
    with progress(ctx, "stack up", summary=False) as bar, bar.ticking():
        report = st.up(slurm=slurm, slurm_nodes=slurm_nodes, k8s=k8s, k8s_nodes=k8s_nodes, progress=bar)
    started = ", ".join(report.started) or "nothing (already running)"
    click.echo(f"started: {started}")
    if report.topics_created:
        click.echo(f"topics created: {len(report.topics_created)}")
    if report.migrations_applied:
        click.echo(f"migrations applied: {', '.join(report.migrations_applied)}")
    if report.slurm_idle_s is not None:
        click.echo(
            f"slurm: {len(report.slurm_nodes)} node(s) idle ({report.slurm_idle_s:.1f}s); "
            f"export SLURM_CONF={st.slurm.conf_file}"
        )
    if report.k8s_s is not None:
        click.echo(
            f"k8s: {len(report.k8s_nodes)} node(s) Ready ({report.k8s_s:.1f}s); "
            f"export KUBECONFIG={st.k8s.admin_kubeconfig}"
        )
    if cluster:
        # Every other process must be told, or it would use the one-node stack's ports.
        click.echo(
            f"cluster: {s.kafka.bootstrap_servers}; ClickHouse {s.clickhouse.url}; export {CLUSTER_ENV}=true"
        )
    click.echo(f"stack healthy in {report.seconds:.1f}s")


@stack.command()
@click.pass_context
@friendly_errors
def down(ctx: click.Context) -> None:
    """Stop this stack home's Kafka, ClickHouse, Slurm and Kubernetes processes, the cluster stack's
    too (and nothing else)."""
    s = settings(ctx)
    stopped = Stack(s).down()
    # Nothing: perhaps a stack of another home runs -- say which one was looked in.
    click.echo(f"stopped: {', '.join(stopped) or f'nothing was running ({home_note(s)})'}")


@stack.command()
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
@friendly_errors
def reset(ctx: click.Context, yes: bool) -> None:
    """Stop the stack and delete its data (topics, tables) under the stack home."""
    s = settings(ctx)
    if not yes:
        click.confirm(
            f"Delete all Kafka, ClickHouse, Slurm and Kubernetes data under {s.stack.home_path}?", abort=True
        )
    stopped = Stack(s).reset()
    click.echo(f"stopped: {', '.join(stopped) or 'nothing was running'}; data deleted")


@stack.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_CLUSTER_OPTION
@click.pass_context
@friendly_errors
def status(ctx: click.Context, as_json: bool, cluster: bool) -> None:
    """Endpoints and health; exit code 0 only when both servers are healthy (and, when it runs or
    is asked for, every process of the cluster stack)."""
    s = _settings(ctx, cluster)
    st = Stack(s).status()
    if as_json:
        click.echo(json.dumps(st, sort_keys=True))
    else:
        k, c = st["kafka"], st["clickhouse"]
        ok = {True: "healthy", False: "DOWN"}
        click.echo(f"kafka       {ok[k['healthy']]:8} {k['bootstrap_servers']}")
        click.echo(f"clickhouse  {ok[c['healthy']]:8} {c['url']} database={c['database']}")
        sl = st.get("slurm") or {}
        if sl.get("running"):
            nodes = " ".join(f"{n['name']}={n['state']}" for n in sl["nodes"]) or sl.get("error", "")
            click.echo(f"slurm       {ok[sl['healthy']]:8} {nodes}")
        k8 = st.get("k8s") or {}
        if k8.get("running"):
            nodes = " ".join(
                n["name"] + ("" if n["ready"] else "=NotReady") + ("=cordoned" if n["cordoned"] else "")
                for n in k8["nodes"]
            )
            click.echo(f"k8s         {ok[k8['healthy']]:8} {k8['server']} {nodes or k8.get('error', '')}")
            click.echo(f"            KUBECONFIG={k8['kubeconfig']}")
        cl = st.get("cluster") or {}
        if cl.get("running") or s.stack.cluster:
            for part in [*cl["kafka"], *cl["clickhouse"]]:
                where = part.get("bootstrap") or part.get("url")
                click.echo(f"  {part['name']:14}{ok[part['healthy']]:8} {where}")
            zk = cl["zookeeper"]
            click.echo(f"  {'zookeeper':14}{ok[zk['healthy']]:8} 127.0.0.1:{zk['port']}")
        if st.get("home"):
            click.echo(f"home        {st['home']} ({home_origin(s)})")
    ctx.exit(0 if st["healthy"] else 1)


@click.command()
@click.pass_context
@friendly_errors
def migrate(ctx: click.Context) -> None:
    """Apply the ClickHouse migrations that are not yet recorded (idempotent)."""
    store = ClickHouseStore(settings(ctx).clickhouse)
    applied = store.migrate()
    click.echo("applied: " + (", ".join(f"{m.version:04d}_{m.name}" for m in applied) or "none (up to date)"))


@click.group()
def store() -> None:
    """ClickHouse store maintenance."""


@store.command()
@click.option("--keep-days", type=click.IntRange(min=0), default=14, show_default=True)
@click.pass_context
@friendly_errors
def prune(ctx: click.Context, keep_days: int) -> None:
    """Drop daily partitions of raw telemetry older than --keep-days (retention)."""
    dropped = ClickHouseStore(settings(ctx).clickhouse).prune(keep_days)
    for table, part in dropped:
        click.echo(f"dropped {table} partition {part}")
    click.echo(f"{len(dropped)} partition(s) dropped")


COMMANDS = [stack, migrate, store]
