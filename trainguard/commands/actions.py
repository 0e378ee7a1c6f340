"""``trainguard actions``: run the action service, and operate it.

* ``trainguard actions [run]`` -- consume decisions and drive recoveries (until SIGINT/SIGTERM);
  its settings: the config file's ``actions`` section, ``TRAINGUARD__ACTIONS__*``, then ``run``'s
  options (``--job``, ``--executor``, ``--state-dir``; ``--print-config`` shows the result), every
  key in ``docs/configuration.md``;
* ``trainguard actions status [--job J] [--json]`` -- recent recoveries, their states and steps;
* ``trainguard actions release ID`` / ``cancel ID`` -- let a held recovery go on, or drop it;
* ``trainguard actions add-standby --job J NODE...`` -- put healthy nodes into the job's standby
  pool; ``return-node --job J NODE...`` -- give nodes the job evicted back to it once repaired (a
  swap never takes an evicted node otherwise).  Both write the service's state store, as
  ``release`` does; a recovery held for want of a spare takes them once released;
* ``trainguard actions code-update --job J --version V [--urgent] [--previous P]`` -- request a
  code change (a restart decision on the decisions topic: urgent now, otherwise at the next
  recovery, forced after ``lazy_update_max_wait_s``);
* ``trainguard actions versions --job J`` -- the job's recorded code changes.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
import uuid
from datetime import UTC, datetime
from typing import Any

import click

from trainguard.context import friendly_errors, settings
from trainguard.schemas.base import now_ms


def _config(ctx: click.Context, **overrides: Any) -> Any:
    """The ``actions`` settings: the file's section, ``TRAINGUARD__ACTIONS__*``, then ``overrides``
    (``run``'s options; None: not given)."""
    from trainguard.actions.config import ActionsConfig
    from trainguard.infra.config import component_config

    cfg = component_config(settings(ctx), "actions", ActionsConfig)
    given = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(cfg, **given) if given else cfg


def effective_config(cfg: Any) -> dict[str, Any]:
    """``cfg`` as the mapping of an ``actions`` section, its executor's options checked against
    the executor's config class and completed with their defaults."""
    from trainguard.actions.executors.base import find_executor
    from trainguard.schemas.config import load_config

    options: Any = load_config(find_executor(cfg.executor).config_cls, cfg.executor_options)
    return {**dataclasses.asdict(cfg), "executor_options": dataclasses.asdict(options)}


def _store(ctx: click.Context) -> Any:
    from trainguard.actions.service import open_store

    return open_store(settings(ctx), _config(ctx))


def _elector(cfg: Any) -> Any:
    """The leader elector of ``actions.leader_lease`` (None when there is no election)."""
    if not cfg.leader_lease:
        return None
    namespace, _, name = cfg.leader_lease.partition("/")
    if not namespace or not name:
        raise click.ClickException(
            f"actions.leader_lease must be <namespace>/<name>, not {cfg.leader_lease!r}"
        )
    from kubernetes import client, config

    from trainguard.infra.k8s.lease import LeaseElector

    if cfg.leader_kubeconfig:
        api = config.new_client_from_config(config_file=cfg.leader_kubeconfig)
    else:
        try:
            config.load_incluster_config()
            api = client.ApiClient()
        except config.ConfigException:
            api = config.new_client_from_config()
    lease_s = cfg.leader_lease_s
    return LeaseElector(api, namespace, name, lease_s=lease_s, renew_s=max(1.0, lease_s / 3))


def _run(ctx: click.Context, **overrides: Any) -> None:
    from trainguard.actions.service import ActionService

    cfg = _config(ctx, **overrides)
    stop, lost = threading.Event(), threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    elector = _elector(cfg)
    if elector is not None:
        where = f"{elector.namespace}/{elector.name}"
        click.echo(f"action service {elector.identity}: waiting for the leader lease {where}", err=True)
        if not elector.acquire(
            stop, lambda holder: click.echo(f"  lease held by {holder or 'nobody'}", err=True)
        ):
            return
        click.echo(f"action service {elector.identity}: leading ({where})", err=True)
        threading.Thread(target=elector.keep, args=(stop, lost), name="leader-lease", daemon=True).start()
    try:
        service = ActionService(settings(ctx), cfg)
        click.echo(f"action service up (executor {service.executor.name}, state in {service.dir})", err=True)
        service.run(stop)
    finally:
        if elector is not None and not lost.is_set():
            elector.release()
    if lost.is_set():
        raise click.ClickException(
            f"lost the leader lease {elector.namespace}/{elector.name} (not renewed for "
            f"{elector.lease_s - elector.renew_s:.0f}s, or taken over): stopped acting; "
            "restart to stand again"
        )


@click.group("actions", invoke_without_command=True)
@click.pass_context
@friendly_errors
def actions(ctx: click.Context) -> None:
    """The action service: without a subcommand, run it (as `run` does, with the configured
    settings; `trainguard actions run --help` says where they come from)."""
    if ctx.invoked_subcommand is None:
        _run(ctx)


@actions.command("run")
@click.option(
    "--job",
    "jobs",
    multiple=True,
    metavar="NAME",
    help="Act on this job only; repeat for several (replaces actions.jobs; default: every job).",
)
@click.option(
    "--executor",
    default=None,
    metavar="NAME",
    help="Executor plugin: dry_run (the default: acts on nothing), slurm, kubernetes, or one a "
    "plugin registers (replaces actions.executor; its options stay actions.executor_options).",
)
@click.option(
    "--state-dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Where the progress store and the executor's state live (replaces actions.state_dir; "
    "default: <stack home>/actions).",
)
@click.option(
    "--print-config",
    is_flag=True,
    help="Print the settings the service would run with (JSON, executor options with their "
    "defaults) and exit.",
)
@click.pass_context
@friendly_errors
def run(
    ctx: click.Context, jobs: tuple[str, ...], executor: str | None, state_dir: str | None, print_config: bool
) -> None:
    """Consume decisions and drive recoveries until interrupted (SIGINT, SIGTERM).

    Settings, lowest priority first: the defaults; the `actions` section of the config file
    (trainguard --config FILE, or $TRAINGUARD_CONFIG); TRAINGUARD__ACTIONS__<KEY> variables
    (nested keys joined by __, values read as YAML: TRAINGUARD__ACTIONS__JOBS='[llm]'); these
    options. Unknown keys are errors. Every key -- jobs, state_dir, executor, executor_options,
    the safety limits, retries -- and each executor's options, with defaults: docs/configuration.md.

    \b
    actions:
      executor: slurm
      executor_options: {step_command: [trainguard, launch, --job, llm, --, python, train.py]}
      jobs: [llm]

    Kafka, ClickHouse, the signing keys and the stack home (the default state) come from the same
    file's kafka, clickhouse, signing and stack sections and $TRAINGUARD_HOME.
    """
    overrides = {"jobs": list(jobs) if jobs else None, "executor": executor, "state_dir": state_dir}
    if print_config:
        from trainguard.actions.service import state_dir as resolved_state_dir

        cfg = _config(ctx, **overrides)
        click.echo(json.dumps({"actions": effective_config(cfg)}, indent=2))
        click.echo(f"state in {resolved_state_dir(settings(ctx), cfg)}", err=True)
        return
    _run(ctx, **overrides)


def _when(ms: int | None) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="seconds")


@actions.command("status")
@click.option("--job", default=None, help="Only this job.")
@click.option("--limit", default=30, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per recovery.")
@click.pass_context
@friendly_errors
def status_cmd(ctx: click.Context, job: str | None, limit: int, as_json: bool) -> None:
    """Recent recoveries: state, path taken, steps; held ones say why."""
    from trainguard.actions.service import status

    store = _store(ctx)
    try:
        rows = status(store, job, limit)
        pause = store.paused()
    finally:
        store.close()
    if pause is not None:
        click.echo(f"PAUSED by {pause['by']} at {_when(pause['ts_ms'])}: {pause['reason']}", err=True)
    for r in rows:
        if as_json:
            click.echo(json.dumps(r))
            continue
        steps = " ".join(f"{s['key']}:{s['status']}" for s in r["steps"])
        click.echo(
            f"{_when(r['accepted_ms'])}  {r['job']:18} {r['action']:9} {r['state']:12} {r['path']:15} "
            f"{r['decision_id'][:12]}  {steps}"
        )
        if r["held_reason"]:
            click.echo(f"    held: {r['held_reason']}")
    if not as_json:
        click.echo(f"{len(rows)} recovery(ies) in {store.path}", err=True)


@actions.command("release")
@click.argument("decision_id")
@click.pass_context
@friendly_errors
def release(ctx: click.Context, decision_id: str) -> None:
    """Let a held recovery go past the limit that held it (the running service picks it up)."""
    store = _store(ctx)
    try:
        rec = store.release(decision_id)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        store.close()
    click.echo(f"{decision_id}: released, continues in state {rec.state.value}")


def _offer(ctx: click.Context, job: str, nodes: tuple[str, ...], kind: str) -> None:
    """Put ``nodes`` into ``job``'s standby pool as ``kind`` (see :func:`offer_problems`)."""
    import getpass

    from trainguard.actions.standby import offer_problems
    from trainguard.actions.state import RecoveryState

    names = list(dict.fromkeys(nodes))
    store = _store(ctx)
    try:
        problems = offer_problems(job, store.spec(job), names, store.evicted_machines(job), kind)
        if problems:
            raise click.ClickException("; ".join(problems))
        store.offer_machines(job, names, kind, getpass.getuser(), now_ms())
        held = [r for r in store.recoveries(job, limit=100) if r.state is RecoveryState.HELD]
    finally:
        store.close()
    what = "back in" if kind == "returned" else "in"
    click.echo(f"{' '.join(names)}: {what} the standby pool of job {job}")
    for r in held:
        click.echo(
            f"  recovery {r.decision_id} is held at {r.held_step}; "
            f"`trainguard actions release {r.decision_id}` lets it go on",
            err=True,
        )


@actions.command("add-standby")
@click.option("--job", required=True, help="The job whose standby pool gets the nodes.")
@click.argument("nodes", nargs=-1, required=True)
@click.pass_context
@friendly_errors
def add_standby(ctx: click.Context, job: str, nodes: tuple[str, ...]) -> None:
    """Put healthy NODES into a job's standby pool: the next swap may take them.

    A node the job evicted is refused here (use return-node once it is repaired); on Slurm a
    standby must be a node of the job's allocation."""
    _offer(ctx, job, nodes, "standby")


@actions.command("return-node")
@click.option("--job", required=True, help="The job that evicted the nodes.")
@click.argument("nodes", nargs=-1, required=True)
@click.pass_context
@friendly_errors
def return_node(ctx: click.Context, job: str, nodes: tuple[str, ...]) -> None:
    """Give NODES the job evicted back to its standby pool, once repaired.

    The action service never takes an evicted node again until it is returned (and excludes it
    again if it is evicted again).  Resume or uncordon it in the cluster too."""
    _offer(ctx, job, nodes, "returned")


@actions.command("cancel")
@click.argument("decision_id")
@click.pass_context
@friendly_errors
def cancel(ctx: click.Context, decision_id: str) -> None:
    """Drop a held recovery (the job's next decisions can then run)."""
    from trainguard.actions.state import InvalidStateTransition, RecoveryState

    store = _store(ctx)
    try:
        store.transition(
            decision_id, RecoveryState.CANCELLED, finished_ms=now_ms(), detail="cancelled by operator"
        )
    except (KeyError, InvalidStateTransition) as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        store.close()
    click.echo(f"{decision_id}: cancelled")


@actions.command("pause")
@click.option("--reason", required=True, help="Why (shown in the service's log and in `status`).")
@click.pass_context
@friendly_errors
def pause(ctx: click.Context, reason: str) -> None:
    """Stop every recovery before its next step, persistently (decisions are still queued)."""
    import getpass

    store = _store(ctx)
    try:
        store.pause(reason, getpass.getuser(), now_ms())
    finally:
        store.close()
    click.echo("paused: no recovery step runs until `trainguard actions resume`")


@actions.command("resume")
@click.pass_context
@friendly_errors
def resume(ctx: click.Context) -> None:
    """Lift a pause: queued and interrupted recoveries continue."""
    store = _store(ctx)
    try:
        was = store.resume()
    finally:
        store.close()
    click.echo("resumed" if was else "was not paused")


@actions.command("code-update")
@click.option("--job", required=True)
@click.option("--version", "version", required=True, help="The code version to switch to.")
@click.option("--urgent", is_flag=True, help="Apply now (halts training); default: at the next recovery.")
@click.option("--previous", default="", help="Version running now (recorded as baseline for rollbacks).")
@click.option("--reason", default="", help="Why (recorded with the change).")
@click.pass_context
@friendly_errors
def code_update(ctx: click.Context, job: str, version: str, urgent: bool, previous: str, reason: str) -> None:
    """Request a code change for a job (prints the decision id)."""
    from trainguard.actions.plans import CodeUpdate
    from trainguard.infra.bus import EventProducer, signer_for
    from trainguard.schemas.topics import DECISIONS

    decision = CodeUpdate(version, urgent=urgent, previous=previous).decision(
        job, uuid.uuid4().hex, now_ms(), reason
    )
    s = settings(ctx)
    producer = EventProducer(s.kafka, signer=signer_for(s, "operator"))
    try:
        producer.send(decision, DECISIONS).get(timeout=30)
    finally:
        producer.close()
    click.echo(decision.decision_id)


@actions.command("versions")
@click.option("--job", required=True)
@click.pass_context
@friendly_errors
def versions(ctx: click.Context, job: str) -> None:
    """Every recorded code change of a job (baseline, updates, rollbacks, pending)."""
    store = _store(ctx)
    try:
        changes, stack = store.code_changes(job), store.version_stack(job)
    finally:
        store.close()
    for ch in changes:
        click.echo(
            f"{_when(ch.requested_ms)}  {ch.kind:8} {ch.version:20} {ch.status:10} "
            f"applied={_when(ch.applied_ms)} {ch.reason}"
        )
    click.echo(f"current: {stack[-1] if stack else '-'}", err=True)


COMMANDS = [actions]
