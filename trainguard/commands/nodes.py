"""``trainguard nodes``: evicted nodes on their way back into service (issue #39, item 4).

* ``trainguard nodes [list] [--all] [--json]`` -- every node with a recorded eviction, its state
  (evicted, awaiting_repair, validating, returned, quarantined), since when, why and by whom, and
  its evictions in the quarantine window; reads new evictions first (``sync``);
* ``trainguard nodes sync`` -- record the evictions not recorded yet (the action service's evict
  steps, preflights that drained or cordoned a node); a node evicted ``quarantine_evictions``
  times within ``quarantine_window_days`` is quarantined and its scheduler reason says so;
* ``trainguard nodes repaired NODE [--by NAME]`` -- an operator repaired NODE: it runs the
  ``standard`` diag level on the node (Slurm: a step in a reservation of its own; Kubernetes: a
  pod pinned to it) and is resumed / uncordoned only if it passes; otherwise it stays drained /
  cordoned with the finding as its reason and waits for repair again;
* ``trainguard nodes release NODE [--by NAME] [--reason TEXT]`` -- a person lifts a quarantine
  (the node then waits for repair and validation like any other);
* ``trainguard nodes history NODE [--json]`` -- every transition of one node.

Settings: the config file's ``nodes`` section (``TRAINGUARD__NODES__*``), every key in
``docs/configuration.md``; ClickHouse from the ``clickhouse`` section.  ``--by`` defaults to
``$USER``.  Exit status 1 when a validation did not pass.
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from trainguard.context import friendly_errors, settings


def _config(ctx: click.Context) -> Any:
    from trainguard.actions.node_config import NodeReturnConfig
    from trainguard.infra.config import component_config

    return component_config(settings(ctx), "nodes", NodeReturnConfig)


def _scheduler(cfg: Any) -> Any:
    if cfg.scheduler == "slurm":
        from trainguard.actions.node_slurm import SlurmNodes

        return SlurmNodes(cfg)
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    from trainguard.actions.errors import SchedulerError
    from trainguard.actions.node_kubernetes import KubernetesNodes

    try:
        if cfg.kubeconfig:
            config.load_kube_config(config_file=cfg.kubeconfig)
        else:
            config.load_incluster_config()
    except ConfigException as exc:
        raise SchedulerError(f"no Kubernetes credentials (nodes.kubeconfig): {exc}") from None
    return KubernetesNodes(cfg, client.CoreV1Api())


@contextmanager
def _service(ctx: click.Context, scheduler: bool = True) -> Iterator[Any]:
    """The :class:`NodeReturn` of this config; scheduler errors and refusals become clear errors."""
    from trainguard.actions.errors import SchedulerError
    from trainguard.actions.node_return import NodeReturn, Scheduler, TransitionStore
    from trainguard.actions.node_states import TransitionRefused
    from trainguard.infra.clickhouse.store import ClickHouseStore

    cfg = _config(ctx)
    store = ClickHouseStore(settings(ctx).clickhouse)
    try:
        sched: Scheduler = _scheduler(cfg) if scheduler else _NoScheduler()
        yield NodeReturn(cfg, TransitionStore(store), sched)
    except (TransitionRefused, SchedulerError) as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        store.close()


class _NoScheduler:
    """Reading commands (history, ``list --no-sync``) touch no scheduler: any change is refused."""

    name = "none"

    def node(self, node: str) -> None:
        return None

    def validate(self, node: str) -> Any:
        raise RuntimeError("no scheduler access in this command")

    def resume(self, node: str) -> None:
        raise RuntimeError("no scheduler access in this command")

    def hold(self, node: str, reason: str) -> None:
        raise RuntimeError("no scheduler access in this command")


def _node(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A node name as the schemas allow it (no path, no option, no shell word), or a usage error."""
    from trainguard.schemas.names import NODE

    why = NODE.problem(value)
    if why:
        raise click.BadParameter(why)
    return value


def _when(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _plain(t: Any) -> dict[str, Any]:
    return {
        "node": t.node,
        "ts_ms": t.ts_ms,
        "from_state": t.from_state,
        "to_state": t.to_state.value,
        "cause": t.cause.value,
        "by": t.by,
        "ref": t.ref,
        "detail": t.detail,
    }


def _show(transitions: list[Any]) -> None:
    for t in transitions:
        click.echo(
            f"{_when(t.ts_ms)}  {t.node}  {t.from_state or '-'} -> {t.to_state.value}  "
            f"({t.cause.value} by {t.by})  {t.detail}"
        )


@click.group("nodes", invoke_without_command=True)
@click.pass_context
def nodes(ctx: click.Context) -> None:
    """Evicted nodes: their state on the way back into service, repair, validation, quarantine."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(list_cmd)


@nodes.command("list")
@click.option("--all", "show_all", is_flag=True, help="Also nodes returned to service.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per node.")
@click.option("--no-sync", is_flag=True, help="Do not read new evictions first.")
@click.pass_context
@friendly_errors
def list_cmd(
    ctx: click.Context, show_all: bool = False, as_json: bool = False, no_sync: bool = False
) -> None:
    """Every node with a recorded eviction and its state (returned ones with --all)."""
    from trainguard.actions.node_states import evictions_counted

    # A listing never changes the scheduler: it records new evictions (and quarantines) only;
    # `nodes sync` also writes the quarantine into the node's drain reason or taint.
    with _service(ctx, scheduler=False) as svc:
        if not no_sync:
            svc.sync(hold=False)
        everything = svc.transitions.latest()
        now = svc.clock()
    rows = []
    for _name, history in sorted(everything.items()):
        last = history[-1]
        if last.to_state.value == "returned" and not show_all:
            continue
        count = evictions_counted(history, now, svc.cfg.policy.window_ms)
        rows.append({**_plain(last), "state": last.to_state.value, "evictions_in_window": count})
    if as_json:
        for r in rows:
            click.echo(json.dumps(r, sort_keys=True))
        return
    if not rows:
        click.echo("no evicted node" + ("" if show_all else " out of service (--all shows returned ones)"))
        return
    days = svc.cfg.quarantine_window_days
    width = max(20, *(len(r["node"]) for r in rows))
    click.echo(f"{'NODE':<{width}} {'STATE':<16} {'SINCE (UTC)':<20} {f'EVICTIONS/{days:g}d':<14} WHY")
    for r in rows:
        click.echo(
            f"{r['node']:<{width}} {r['state']:<16} {_when(r['ts_ms']):<20} {r['evictions_in_window']:<14} "
            f"{r['cause']} by {r['by']}: {r['detail']}"
        )


@nodes.command("sync")
@click.pass_context
@friendly_errors
def sync_cmd(ctx: click.Context) -> None:
    """Record the evictions not recorded yet (and quarantine nodes evicted too often)."""
    with _service(ctx) as svc:
        new = svc.sync()
    _show(new)
    click.echo(f"{len(new)} transition(s) recorded")


@nodes.command("repaired")
@click.argument("node", callback=_node)
@click.option("--by", default=None, help="Who repaired it (default: $USER).")
@click.pass_context
@friendly_errors
def repaired_cmd(ctx: click.Context, node: str, by: str | None) -> None:
    """NODE is repaired: validate it (the standard diag level) and return it only if it passes."""
    who = by or os.environ.get("USER") or getpass.getuser()
    with _service(ctx) as svc:
        svc.sync()
        new = svc.repaired(node, who, f"repaired-{uuid.uuid4().hex}")
        state = svc.transitions.history(node)[-1].to_state.value
    _show(new)
    click.echo(f"node {node}: {state}")
    if state != "returned":
        ctx.exit(1)


@nodes.command("release")
@click.argument("node", callback=_node)
@click.option("--by", default=None, help="Who decided (default: $USER).")
@click.option("--reason", default="", help="Why the node may try again (recorded).")
@click.pass_context
@friendly_errors
def release_cmd(ctx: click.Context, node: str, by: str | None, reason: str) -> None:
    """Lift NODE's quarantine: it waits for repair, then `trainguard nodes repaired` validates it."""
    who = by or os.environ.get("USER") or getpass.getuser()
    with _service(ctx) as svc:
        new = svc.release(node, who, f"release-{uuid.uuid4().hex}", reason)
    _show(new)


@nodes.command("history")
@click.argument("node", callback=_node)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per transition.")
@click.pass_context
@friendly_errors
def history_cmd(ctx: click.Context, node: str, as_json: bool) -> None:
    """Every transition of NODE, oldest first."""
    with _service(ctx, scheduler=False) as svc:
        history = svc.transitions.history(node)
    if not history:
        raise click.ClickException(f"node {node} has no recorded eviction")
    if as_json:
        for t in history:
            click.echo(json.dumps(_plain(t), sort_keys=True))
    else:
        _show(history)


COMMANDS: list[click.Command] = [nodes]
