"""``trainguard exporter`` (the node exporter) and the commands that drive it from the control
plane: ``trainguard capture-stacks`` and ``trainguard set-interval``.

``trainguard exporter --node NAME --job JOB [--root PATH] [--kernel-log FILE] [--once --print]``
runs every enabled source on its interval and ships the events to Kafka; ``--once --print`` runs
one round and prints the events as JSON lines instead (no Kafka, no state written).
"""

from __future__ import annotations

import json
import logging
import sys
import uuid
from collections.abc import Callable
from typing import Any

import click

from trainguard.context import friendly_errors, settings
from trainguard.infra.bus import EventProducer
from trainguard.schemas.base import now_ms
from trainguard.schemas.codec import to_dict
from trainguard.schemas.config import deep_merge, load_yaml_file
from trainguard.schemas.control import Command, CommandKind
from trainguard.schemas.topics import COMMANDS as COMMAND_TOPIC

log = logging.getLogger(__name__)


def _overrides(
    node: str | None,
    job: str | None,
    root: str | None,
    kernel_log: str | None,
    state_dir: str | None,
    socket_path: str | None,
    pids: tuple[int, ...],
    cgroup: str | None,
    cmd_pattern: str | None,
    disable: tuple[str, ...],
    intervals: tuple[str, ...],
    expect_gpus: int | None,
    metrics_port: int | None,
) -> dict[str, Any]:
    """Command-line flags as a config mapping (they win over the file and the environment)."""
    data: dict[str, Any] = {}
    for key, given in (("node", node), ("job", job), ("root", root), ("state_dir", state_dir)):
        if given is not None:
            data[key] = given
    sections: dict[str, dict[str, Any]] = {}
    if kernel_log is not None:
        sections.setdefault("kernel_log", {})["path"] = kernel_log
    if socket_path is not None:
        sections.setdefault("reporter", {})["socket"] = socket_path
    if pids:
        sections.setdefault("process", {})["pids"] = list(pids)
    if cgroup is not None:
        sections.setdefault("process", {})["cgroup"] = cgroup
    if cmd_pattern is not None:
        sections.setdefault("process", {})["cmd_pattern"] = cmd_pattern
    if expect_gpus is not None:
        sections.setdefault("nvml", {})["expect_gpus"] = expect_gpus
    if metrics_port is not None:
        sections.setdefault("metrics", {})["port"] = metrics_port
    for name in disable:
        sections.setdefault(name, {})["enabled"] = False
    for spec in intervals:
        name, sep, seconds = spec.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if not sep or value <= 0:
            raise click.BadParameter(f"{spec!r}: expected SOURCE=SECONDS", param_hint="--interval")
        sections.setdefault(name, {})["interval_s"] = value
    return {**data, **sections}


def exporter_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The exporter's command-line options, shared with commands that run it with another GPU
    backend (a plugin's simulated GPUs)."""
    options = [
        click.option("--node", help="This machine's name (default: the hostname)."),
        click.option("--job", help="The training job running here."),
        click.option(
            "--exporter-config", type=click.Path(dir_okay=False), help="YAML file of ExporterConfig settings."
        ),
        click.option("--root", help="Prefix of every system path read (PATH/proc, PATH/sys/class/net, ...)."),
        click.option(
            "--kernel-log", help="Kernel log to follow (a file or /dev/kmsg; default ROOT/dev/kmsg)."
        ),
        click.option("--state-dir", help="Spool and kernel-log position live here."),
        click.option("--socket", "socket_path", help="Unix socket training reporters send to."),
        click.option("--pid", "pids", type=int, multiple=True, help="A training process (repeatable)."),
        click.option(
            "--cgroup", help="cgroup (v2, relative to ROOT/sys/fs/cgroup) holding the training processes."
        ),
        click.option(
            "--cmd-pattern",
            help="Regular expression matching training processes' command lines (ranks started by "
            "`trainguard launch` need none: their launchers register them).",
        ),
        click.option("--disable", multiple=True, help="Disable a source by name (repeatable)."),
        click.option(
            "--interval", "intervals", multiple=True, metavar="SOURCE=SECONDS", help="Override an interval."
        ),
        click.option("--expect-gpus", type=click.IntRange(0, 1024), help="GPUs this node should have."),
        click.option(
            "--metrics-port",
            type=click.IntRange(0, 65535),
            help="Port of the Prometheus /metrics endpoint (0: none; default 9401, metrics.port).",
        ),
        click.option("--once", is_flag=True, help="Run one round of every enabled source and exit."),
        click.option(
            "--print", "print_", is_flag=True, help="With --once: print events as JSON lines, no Kafka."
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def run_exporter(
    ctx: click.Context, exporter_config: str | None, flags: dict[str, Any], nvml: Any = None
) -> None:
    """Run the exporter as the options in ``flags`` say (``nvml``: a GPU backend other than NVML)."""
    from trainguard.streams.exporter.config import load_exporter_config

    once, print_ = flags.pop("once"), flags.pop("print_")
    if print_ and not once:
        raise click.UsageError("--print needs --once")
    file_data = load_yaml_file(exporter_config) if exporter_config else {}
    cfg = load_exporter_config(deep_merge(file_data, _overrides(**flags)))
    if print_:
        from trainguard.streams.exporter.runner import Exporter

        out = sys.stdout
        runner = Exporter(cfg, lambda ev: None, nvml=nvml, once=True)
        for event in runner.run_once():
            out.write(json.dumps(to_dict(event), separators=(",", ":")) + "\n")
        runner.stop()
        return
    from trainguard.infra.bus import verifier_for
    from trainguard.streams.exporter.service import ExporterService

    s = settings(ctx)
    service = ExporterService(cfg, s.kafka, nvml=nvml, verifier=verifier_for(s))
    if once:
        events = service.exporter.run_once()
        service.delivery.start()
        service.stop(drain_timeout_s=30.0)
        left = service.spool.pending_records
        click.echo(f"published {len(events)} events; {left} left in the spool")
        if left:
            raise click.ClickException(
                f"{left} events could not be delivered (kept in {cfg.state_dir}/spool)"
            )
        return
    service.run_forever()


@click.command("exporter")
@exporter_options
@click.pass_context
@friendly_errors
def exporter(ctx: click.Context, exporter_config: str | None, **flags: Any) -> None:
    """Run the node exporter: GPU, kernel log, NIC, host, process, reporter and heartbeat sources."""
    run_exporter(ctx, exporter_config, flags)


def _send_command(ctx: click.Context, cmd: Command) -> None:
    producer = EventProducer(settings(ctx).kafka)
    try:
        producer.send(cmd, COMMAND_TOPIC).get(timeout=30)
    finally:
        producer.close()
    click.echo(cmd.command_id)


@click.command("capture-stacks")
@click.option("--node", default="", help="Node whose exporter captures (default: every node).")
@click.option("--job", default="", help="Only exporters of this job.")
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--interval", "interval_s", default=10.0, show_default=True, help="Seconds between rounds.")
@click.pass_context
@friendly_errors
def capture_stacks(ctx: click.Context, node: str, job: str, rounds: int, interval_s: float) -> None:
    """Ask exporters for py-spy dumps of every training process (prints the capture id)."""
    cmd = Command(
        command_id=uuid.uuid4().hex,
        ts_ms=now_ms(),
        kind=CommandKind.CAPTURE_STACKS,
        node=node,
        job=job,
        args={"rounds": rounds, "interval_s": interval_s},
    )
    _send_command(ctx, cmd)


@click.command("set-interval")
@click.argument("source")
@click.argument("seconds", type=click.FloatRange(0.01, 86_400))
@click.option("--node", default="", help="Node to change (default: every node).")
@click.option("--job", default="", help="Only exporters of this job.")
@click.pass_context
@friendly_errors
def set_interval(ctx: click.Context, source: str, seconds: float, node: str, job: str) -> None:
    """Change a source's sampling interval on running exporters."""
    cmd = Command(
        command_id=uuid.uuid4().hex,
        ts_ms=now_ms(),
        kind=CommandKind.SET_INTERVAL,
        node=node,
        job=job,
        args={"source": source, "interval_s": seconds},
    )
    _send_command(ctx, cmd)


COMMANDS: list[click.Command] = [exporter, capture_stacks, set_interval]
