"""``trainguard preflight``: judge and record a node test run made before a job starts on the node.

The schedulers' hooks call it -- the Slurm prolog ``infra/deploy/prolog.sh`` and the Kubernetes
init container of ``infra/deploy/k8s/preflight/`` -- after ``trainguard diag --json --out FILE``:

``trainguard preflight verdict FILE --diag-exit N``
    prints three lines: what to do (``drain``, ``warn`` or ``none``, by the policy), the outcome
    (``passed``, ``failed``, ``error``) and the reason line for the scheduler (``trainguard
    preflight: <test>: <finding>``; empty when the node passed).  The hook drains or cordons.

``trainguard preflight record FILE --diag-exit N --node NODE --origin slurm-prolog --action-taken drained``
    writes the :class:`~trainguard.schemas.telemetry.NodeCheck` under the node's log directory and
    publishes it to ``trainguard.telemetry.nodechecks`` (the sink stores it in ``node_checks``),
    with the node's records a Kafka outage left pending; never fails the hook for Kafka.

``trainguard preflight cordon --node NODE --reason LINE``
    Kubernetes: cordons the node and annotates it with the reason (the init container's
    ServiceAccount may patch nodes).

The judgement itself is :mod:`trainguard.diag.preflight` (pure).
"""

from __future__ import annotations

import contextlib
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from trainguard.context import settings
from trainguard.diag.preflight import PreflightPolicy, Verdict, judge, node_check, read_results
from trainguard.schemas.base import now_ms
from trainguard.schemas.codec import DecodeError, decode, encode
from trainguard.schemas.config import ConfigError
from trainguard.schemas.telemetry import CheckAction, NodeCheck

#: a node's records sent per run besides its own: the backlog of an outage drains over a few jobs
#: instead of holding one prolog up.
MAX_RESEND = 20
#: how much of diag's stderr becomes an error's reason (its last line says why it stopped).
STDERR_TAIL_CHARS = 400

#: the Kubernetes annotations and label a preflight cordon sets (item 4 of issue #39 reads them to
#: tell its cordons from an operator's).
ANNOTATION_REASON = "trainguard.io/preflight-reason"
ANNOTATION_AT = "trainguard.io/preflight-at"
ANNOTATION_POD = "trainguard.io/preflight-pod"
LABEL = "trainguard.io/preflight"


def _diag_error(path: str | None) -> str:
    """The last non-empty line of diag's stderr file, capped (empty when there is none)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            tail = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1][-STDERR_TAIL_CHARS:] if lines else ""


def _verdict(results: str, diag_exit: int, timeout_s: float | None, diag_stderr: str | None) -> Verdict:
    lines, problems = read_results(results)
    return judge(lines, diag_exit, problems, timeout_s=timeout_s, diag_error=_diag_error(diag_stderr))


def _policy(policy: str, on_error: str) -> PreflightPolicy:
    try:
        return PreflightPolicy(policy, on_error)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


_results_arg = click.argument("results", type=click.Path(dir_okay=False))
_common = [
    click.option("--diag-exit", type=int, required=True, help="trainguard diag's exit status."),
    click.option(
        "--timeout-s",
        type=click.FloatRange(min=0),
        help="The limit diag ran under (timeout(1)): exit 124/137 is then a hang, a failure.",
    ),
    click.option(
        "--diag-stderr",
        type=click.Path(dir_okay=False),
        help="diag's stderr, saved: its last line is an error's reason.",
    ),
    click.option("--policy", type=click.Choice(["drain", "warn"]), default="drain", show_default=True),
    click.option(
        "--on-error",
        type=click.Choice(["allow", "drain"]),
        default="allow",
        show_default=True,
        help="When diag could not judge the node: let the job start, or take the node out.",
    ),
]


def _with_common(fn: Any) -> Any:
    for deco in reversed(_common):
        fn = deco(fn)
    return _results_arg(fn)


@click.group("preflight")
def preflight() -> None:
    """Judge and record node tests run before a job (Slurm prolog, Kubernetes init container)."""


@preflight.command("verdict")
@_with_common
def verdict_cmd(
    results: str,
    diag_exit: int,
    timeout_s: float | None,
    diag_stderr: str | None,
    policy: str,
    on_error: str,
) -> None:
    """Print what to do (drain/warn/none), the outcome and the scheduler's reason line."""
    v = _verdict(results, diag_exit, timeout_s, diag_stderr)
    click.echo(_policy(policy, on_error).action(v.outcome))
    click.echo(v.outcome.value)
    click.echo(v.reason)


@preflight.command("record")
@_with_common
@click.option("--node", required=True, help="The node tested (Slurm: $SLURMD_NODENAME; k8s: spec.nodeName).")
@click.option(
    "--origin",
    default="manual",
    show_default=True,
    help="Who ran the tests: slurm-prolog, k8s-init, manual.",
)
@click.option("--job", default="", help="The scheduler's job (Slurm job id, pod name).")
@click.option("--level", default="quick", show_default=True, help="The diag level that ran.")
@click.option(
    "--action-taken",
    type=click.Choice([a.value for a in CheckAction]),
    required=True,
    help="What the hook did to the node.",
)
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False),
    help="Keep the record (and resend pending ones) under LOG_DIR/NODE/.",
)
@click.option(
    "--publish",
    type=click.Choice(["auto", "yes", "no"]),
    default="auto",
    show_default=True,
    help="Publish to Kafka; auto: when a config file is given (--config / TRAINGUARD_CONFIG).",
)
@click.option("--publish-timeout-s", type=click.FloatRange(0.5, 300), default=10.0, show_default=True)
@click.option(
    "--keep-days",
    type=click.FloatRange(min=0.01),
    default=14.0,
    show_default=True,
    help="Delete this node's preflight files older than this from LOG_DIR/NODE.",
)
@click.pass_context
def record_cmd(
    ctx: click.Context,
    results: str,
    diag_exit: int,
    timeout_s: float | None,
    diag_stderr: str | None,
    policy: str,
    on_error: str,
    node: str,
    origin: str,
    job: str,
    level: str,
    action_taken: str,
    log_dir: str | None,
    publish: str,
    publish_timeout_s: float,
    keep_days: float,
) -> None:
    """Record a preflight: the node's log directory and trainguard.telemetry.nodechecks.

    Exits 0 once the record is kept somewhere (the log directory, or Kafka when there is none);
    Kafka being away is a warning, the record stays pending and the node's next check resends it.
    """
    _policy(policy, on_error)
    v = _verdict(results, diag_exit, timeout_s, diag_stderr)
    event = node_check(
        v,
        node=node,
        origin=origin,
        ts_ms=now_ms(),
        action=CheckAction(action_taken),
        policy=policy,
        job=job,
        level=level,
    )
    try:
        # the codec's checks (a node name that is a path, an over-long field) before anything is written
        decode(encode(event), NodeCheck)
    except DecodeError as exc:
        raise click.UsageError(f"cannot record this check: {exc}") from None
    kept: list[Path] = []
    if log_dir:
        node_dir = Path(log_dir) / node
        try:
            node_dir.mkdir(parents=True, exist_ok=True)
            _prune(node_dir, keep_days)
            kept.append(_write_pending(node_dir, event))
        except OSError as exc:  # a full or read-only disk: Kafka may still take the record
            click.echo(f"WARNING: cannot keep the record in {node_dir}: {exc.strerror or exc}", err=True)
    configured = bool(ctx.find_root().ensure_object(dict).get("config_path"))
    wanted = publish == "yes" or (publish == "auto" and configured)
    summary = f"node check {event.check_id[:12]} of {node}: {v.outcome.value}, {action_taken}"
    if not wanted:
        click.echo(
            f"{summary}; kept in {kept[0]}" if kept else f"{summary}; not kept (no --log-dir, no Kafka)"
        )
        return
    pending = _pending(kept[0].parent) if kept else []
    sent, error = _publish(ctx, pending or [event], publish_timeout_s)
    if kept:
        for path, ok in zip(pending, sent, strict=True):
            if ok:
                _mark_sent(path)
    if error:
        where = f"kept pending in {kept[0].parent}" if kept else "NOT kept anywhere (no --log-dir)"
        click.echo(f"{summary}; WARNING: not published ({error}); {where}", err=True)
        if not kept:
            ctx.exit(1)
        return
    click.echo(f"{summary}; published ({sum(sent)} record(s))")


def _stamp(ts_ms: int) -> str:
    return datetime.fromtimestamp(ts_ms / 1000, tz=UTC).strftime("%Y%m%dT%H%M%S.%fZ")


def _write_pending(node_dir: Path, event: NodeCheck) -> Path:
    """``<stamp>-<job>-<id>.pending.json`` (the wire encoding), written whole or not at all."""
    path = node_dir / f"{_stamp(event.ts_ms)}-{event.job or 'nojob'}-{event.check_id[:12]}.pending.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(encode(event) + b"\n")
    os.replace(tmp, path)
    return path


def _pending(node_dir: Path) -> list[Path]:
    """The records not yet published, oldest first, the newest :data:`MAX_RESEND` + 1."""
    return sorted(node_dir.glob("*.pending.json"))[-(MAX_RESEND + 1) :]


def _mark_sent(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.replace(path, path.with_name(path.name.replace(".pending.json", ".json")))


def _prune(node_dir: Path, keep_days: float) -> None:
    """Delete this node's preflight files (results, logs, records) older than ``keep_days``."""
    cutoff = time.time() - keep_days * 86400
    for p in node_dir.iterdir():
        with contextlib.suppress(OSError):
            if p.is_file() and not p.is_symlink() and p.stat().st_mtime < cutoff:
                p.unlink()


def _load(item: Path | NodeCheck) -> NodeCheck | None:
    if isinstance(item, NodeCheck):
        return item
    try:
        return decode(item.read_bytes(), NodeCheck)  # type: ignore[return-value]
    except (OSError, DecodeError):
        # Not ours or damaged: set aside, never resent forever.
        with contextlib.suppress(OSError):
            os.replace(item, item.with_name(item.name.replace(".pending.json", ".bad.json")))
        return None


def _publish(ctx: click.Context, items: list[Any], timeout_s: float) -> tuple[list[bool], str]:
    """Send each record (a pending file or an event); returns which were acknowledged and the first
    error ("" when none)."""
    from trainguard.infra.bus import EventProducer
    from trainguard.schemas.topics import NODE_CHECKS

    sent = [False] * len(items)
    deadline = time.monotonic() + timeout_s
    producer = None
    try:
        left_ms = int(timeout_s * 1000)
        # Both bounded: kafka-python waits 30 s for a first broker by default, and a prolog must not.
        extra = {"max_block_ms": left_ms, "bootstrap_timeout_ms": left_ms}
        producer = EventProducer(settings(ctx).kafka, linger_ms=0, extra=extra)
        futures = []
        for i, item in enumerate(items):
            event = _load(item)
            if event is not None:
                futures.append((i, producer.send(event, NODE_CHECKS)))
        for i, fut in futures:
            fut.get(timeout=max(0.5, deadline - time.monotonic()))
            sent[i] = True
        return sent, ""
    except Exception as exc:  # Kafka away, refusing, or the settings wrong: the record waits
        return sent, f"{type(exc).__name__}: {exc}"[:500]
    finally:
        if producer is not None:
            with contextlib.suppress(Exception):
                producer.close(timeout_s=1.0)


# -- Kubernetes ------------------------------------------------------------------------------------


def cordon_body(reason: str, pod: str, at: datetime) -> dict[str, Any]:
    """The node patch of a preflight cordon: unschedulable, with the reason and who found it.

    >>> at = datetime(2026, 11, 27, tzinfo=UTC)
    >>> b = cordon_body("trainguard preflight: memory: cuda:0: 3 bad words", "llm-0", at)
    >>> b["spec"], b["metadata"]["labels"]
    ({'unschedulable': True}, {'trainguard.io/preflight': 'failed'})
    >>> b["metadata"]["annotations"]["trainguard.io/preflight-at"]
    '2026-11-27T00:00:00Z'
    """
    annotations = {ANNOTATION_REASON: reason, ANNOTATION_AT: at.strftime("%Y-%m-%dT%H:%M:%SZ")}
    if pod:
        annotations[ANNOTATION_POD] = pod
    return {
        "spec": {"unschedulable": True},
        "metadata": {"labels": {LABEL: "failed"}, "annotations": annotations},
    }


def cordon_node(api: Any, node: str, reason: str, pod: str = "") -> None:
    """Cordon ``node`` through ``api`` (a ``kubernetes.client.CoreV1Api``) with TrainGuard's reason."""
    api.patch_node(node, cordon_body(reason, pod, datetime.now(tz=UTC)))


@preflight.command("cordon")
@click.option("--node", required=True, help="The node to cordon (the init container's spec.nodeName).")
@click.option("--reason", required=True, help="The reason line (from `trainguard preflight verdict`).")
@click.option("--pod", default="", help="The pod whose preflight failed (annotated on the node).")
@click.option("--kubeconfig", type=click.Path(dir_okay=False), help="Outside a cluster: this kubeconfig.")
def cordon_cmd(node: str, reason: str, pod: str, kubeconfig: str | None) -> None:
    """Cordon a Kubernetes node with TrainGuard's preflight reason (exit 1 when refused)."""
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config.config_exception import ConfigException

    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig)
        else:
            config.load_incluster_config()
    except ConfigException as exc:
        raise click.ClickException(f"no Kubernetes credentials: {exc}") from None
    try:
        cordon_node(client.CoreV1Api(), node, reason, pod)
    except ApiException as exc:
        raise click.ClickException(f"cordon of node {node} refused: {exc.status} {exc.reason}") from None
    except OSError as exc:
        raise click.ClickException(f"cordon of node {node}: API unreachable: {exc}") from None
    click.echo(f"node {node} cordoned: {reason}")
