"""``trainguard agent --job J --node N [options] -- python train.py ...``: a warm node agent.

Runs :class:`trainguard.agent.service.NodeAgent` until SIGTERM/SIGINT: its zygote imports the
``--preload`` modules, it forks this machine's ranks of the first world (``--nodes``; none: a
standby) and then restarts them in place on each signed ``agent_restart`` command, from the Kafka
command topic (the cluster's settings) and from ``POST /command``.  Its state: ``GET /state`` on
``--port`` (200 warm, 503 not) and ``<state dir>/state.json``.  ``trainguard launch --agent`` starts
one per Slurm task, the world taken from Slurm.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import click

from trainguard.context import settings
from trainguard.schemas.config import ConfigError, load_config

PREFIX = "trainguard agent:"


def _csv(values: tuple[str, ...]) -> list[str]:
    return [v for item in values for v in item.split(",") if v]


def run_agent(ctx: click.Context, options: dict[str, Any], base_env: dict[str, str] | None = None) -> None:
    """Build the agent of ``options`` (AgentConfig fields) and serve until a stop signal."""
    from trainguard.agent.config import AgentConfig
    from trainguard.agent.service import NodeAgent
    from trainguard.infra.bus import verifier_for

    try:
        cfg = load_config(AgentConfig, options)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    s = settings(ctx)
    try:
        agent = NodeAgent(cfg, verifier_for(s), s.kafka)
    except ValueError as exc:  # a command the zygote cannot fork
        raise click.UsageError(str(exc)) from None
    if base_env:
        agent.base_env.update(base_env)
    stopping = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    runner = threading.Thread(target=agent.run, name="agent", daemon=True)
    runner.start()
    click.echo(
        f"{PREFIX} job {cfg.job} on {cfg.node}: http://{cfg.host}:{agent.endpoint.port}/state", err=True
    )
    while not stopping.wait(0.5) and runner.is_alive():
        pass
    agent.stop()
    click.echo(f"{PREFIX} job {cfg.job} on {cfg.node}: gone", err=True)


@click.command("agent", context_settings={"allow_interspersed_args": False})
@click.option("--job", required=True, help="The TrainGuard job name.")
@click.option("--node", required=True, help="This machine's name, as the job's node lists name it.")
@click.option("--ranks-per-node", type=int, default=1, show_default=True, help="Ranks on every machine.")
@click.option(
    "--local-rank", "local_ranks", type=int, multiple=True, help="A local rank held here (default: all)."
)
@click.option("--preload", multiple=True, help="Modules the zygote imports (comma-separated or repeated).")
@click.option("--state-dir", default="/run/trainguard/agent", show_default=True, help="state.json, logs.")
@click.option("--host", default="0.0.0.0", show_default=True, help="Address of GET /state, POST /command.")
@click.option("--port", type=int, default=9403, show_default=True, help="Its port (0: any free one).")
@click.option("--kafka/--no-kafka", default=True, help="Also follow the Kafka command topic.")
@click.option("--code-root", default="", help="Code version V lives in CODE_ROOT/V (hot updates).")
@click.option("--code-version", default="", help="The code version to start on.")
@click.option(
    "--nodes", "nodes", multiple=True, help="The first world's machines in rank order (none: standby)."
)
@click.option("--generation", type=int, default=0, show_default=True, help="The first world's generation.")
@click.option("--master-addr", default="", help="The first world's rendezvous host.")
@click.option("--master-port", type=int, default=29500, show_default=True, help="Its port.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def agent(ctx: click.Context, command: tuple[str, ...], **options: Any) -> None:
    """Stay resident on a node, hold a warm zygote, restart the job's ranks in place on signed
    commands: trainguard agent --job J --node N --preload torch -- python train.py"""
    if not command:
        raise click.UsageError("give the training command after --: trainguard agent ... -- python train.py")
    options["preload"] = _csv(options["preload"])
    options["nodes"] = _csv(options["nodes"])
    options["local_ranks"] = list(options["local_ranks"])
    run_agent(ctx, {**options, "command": list(command)})


COMMANDS: list[click.Command] = [agent]
