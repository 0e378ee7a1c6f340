"""``trainguard launch --job J [options] -- CMD ARGS...``: one Slurm task of a training job.

What a job script runs after ``srun`` (one launch per task)::

    srun --ntasks-per-node=8 trainguard launch --job llm --tp 8 --pp 4 -- python train.py ...

Each task maps Slurm's environment to the job topology (:mod:`trainguard.launch_env`), starts CMD
with the usual torch variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``; the address is rank 0's node, by name when it resolves, else its
Slurm ``NodeAddr``, and rank 0 says which) and the reporter's (``TRAINGUARD_JOB``, ``TRAINGUARD_RANK``,
``TRAINGUARD_NODE``, ``TRAINGUARD_REPORTER_SOCKET``), forwards SIGTERM, SIGINT and SIGUSR1 to it and
exits with its exit code (128 + the signal if a signal killed it, as a shell does): Slurm and the
exporter classify the exit by that code.  Slurm itself signals every process of a step, so on
``scancel`` the training process may get the signal twice (from Slurm and forwarded); once the
child is gone the launcher ignores them, so a late one cannot replace the child's exit code.

The node exporter hears from the launcher on its reporter socket (Unix datagrams; never waited
for, never fatal).  Once CMD runs, the launcher registers it (a ``RankRegistration``: job, node,
rank, local rank, CMD's pid and its own), in the background and again every
``--register-interval``, a failed send sooner: the exporter follows the rank and its children with
no process selection of its own, also when it starts after the launcher.  When CMD exits, the
launcher sends its exit status (a ``ProcessExit``: the code, or the signal and 128 + it) before
exiting itself: the exporter cannot read the status of a process it did not start, and a rank
killed by SIGKILL says nothing itself -- without this, a crash was blamed on the first survivor
to report a broken connection.

Rank 0 publishes the job's spec (machines = the step's nodes, standbys = the allocation's other
nodes) to the jobs topic, signed with the ``launcher`` key, in the background: the training
starts at once and never waits for TrainGuard.  Kafka unreachable or no signing key: the attempts
are counted and logged, retried until ``--publish-timeout``, and the training runs on regardless.
A step the action service restarted (``TRAINGUARD_RESTART`` set) publishes nothing: the service
published the spec it restarted on, and the latest spec wins.

``--agent``: the task runs as a warm node agent (:mod:`trainguard.agent`) holding its rank instead
of a plain child: a zygote imports ``--agent-preload`` and forks the rank, and a signed
``agent_restart`` restarts it in place later (docs/guides/warm-agent.md).  Rank 0 still publishes
the spec; the agent registers each forked rank with the exporter and reports an exit it did not
cause.

Readiness: once CMD runs (and, on rank 0, the spec is published or given up on) every task prints
``trainguard launch: job J rank R on NODE ready`` and writes ``--ready-file`` (JSON, atomically).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import click

from trainguard.context import settings
from trainguard.infra.backoff import Backoff
from trainguard.schemas.base import now_ms
from trainguard.schemas.config import ConfigError, load_config

if TYPE_CHECKING:
    from trainguard.launch_env import LaunchConfig, LaunchPlan
    from trainguard.schemas.base import Event
    from trainguard.schemas.workload import ProcessExit

#: signals passed on to the training process.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
#: how long a launcher whose training exited waits for a publish still under way.
EXIT_GRACE_S = 2.0
#: how long the exit report is retried while the exporter's socket queue is full (a missing or
#: dead exporter is not waited for).
EXIT_REPORT_S = 1.0
#: the first retry of a failed registration (doubling up to ``--register-interval``).
REGISTER_RETRY_S = 0.5
PREFIX = "trainguard launch:"


def say(message: str) -> None:
    click.echo(f"{PREFIX} {message}", err=True)


@dataclass
class SpecOutcome:
    """What became of rank 0's job spec: ``published``, ``failed``, or ``not published`` (other ranks,
    ``--no-publish``, a restarted step), with the attempts made and the last error."""

    state: str = "not published"
    attempts: int = 0
    failures: int = 0
    error: str = ""


def publish_spec(plan: LaunchPlan, ctx: click.Context, timeout_s: float) -> SpecOutcome:
    """Publish ``plan``'s JobSpec, retrying Kafka errors until ``timeout_s``; never raises."""
    from trainguard.infra.bus import EventProducer, signer_for
    from trainguard.infra.signing import AuthError
    from trainguard.schemas.topics import JOBS

    out = SpecOutcome()
    deadline = time.monotonic() + timeout_s
    backoff = Backoff(initial_s=1.0, max_s=10.0, jitter=0.3)
    spec = plan.job_spec()
    while True:
        out.attempts += 1
        producer = None
        try:
            s = settings(ctx)
            signer = signer_for(s, "launcher")
            left_ms = max(1000, int((deadline - time.monotonic()) * 1000))
            # Both bounded by what is left: kafka-python waits 30 s for a first broker by default.
            extra = {"max_block_ms": left_ms, "bootstrap_timeout_ms": left_ms}
            producer = EventProducer(s.kafka, signer=signer, extra=extra)
            producer.send(spec, JOBS).get(timeout=max(1.0, deadline - time.monotonic()))
            out.state, out.error = "published", ""
            say(
                f"job spec of {plan.job} published (attempt {out.attempts}): machines "
                f"{','.join(plan.topology.machines)}, standbys {','.join(plan.standbys) or 'none'}"
            )
            return out
        except (ConfigError, AuthError) as exc:  # settings or keys: no retry can fix these
            out.failures += 1
            out.state, out.error = "failed", str(exc)
            break
        except Exception as exc:  # Kafka away or refusing: retried; never let it reach the training
            out.failures += 1
            out.state, out.error = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            if producer is not None:
                with contextlib.suppress(Exception):
                    producer.close(timeout_s=2.0)
        delay = backoff.next_delay()
        if time.monotonic() + delay >= deadline:
            break
        say(
            f"job spec of {plan.job} not published (attempt {out.attempts}): {out.error}; "
            f"retry in {delay:.1f}s"
        )
        time.sleep(delay)
    say(
        f"ERROR: job spec of {plan.job} NOT published after {out.attempts} attempt(s): {out.error}. "
        "The training runs, but TrainGuard does not know its machines and standbys until a spec is "
        "published (check the kafka and signing settings, `trainguard keys init --principal launcher`)"
    )
    return out


class Forwarder:
    """Passes SIGTERM/SIGINT/SIGUSR1 on to the child; signals that come before it exists wait."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self.pending: list[int] = []

    def install(self) -> None:
        for sig in FORWARDED:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.child is None:
            self.pending.append(signum)
        else:
            self._send(signum)

    def ignore(self) -> None:
        """Once the child is gone: nothing to forward, and the launcher must not die of a late
        signal (Slurm signals every process of a cancelled step) with the child's exit code in hand.
        Python's own shutdown puts SIG_DFL back in place of its handlers, but leaves SIG_IGN."""
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_IGN)

    def attach(self, child: subprocess.Popen[bytes]) -> None:
        self.child = child
        while self.pending:
            self._send(self.pending.pop(0))

    def _send(self, signum: int) -> None:
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError):
                self.child.send_signal(signum)


class ExporterLink:
    """Datagrams to the node exporter's reporter socket: never blocks, never raises."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sent = 0
        self.failures = 0
        #: the errno and text of the last failed send.
        self.errno = 0
        self.error = ""
        self._lock = threading.Lock()  # the registration thread and the main thread both send
        self.sock: socket.socket | None = None
        try:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self.sock.setblocking(False)
        except OSError as exc:  # out of file descriptors: the training runs on, unreported
            self.errno, self.error = exc.errno or 0, exc.strerror or str(exc)

    def send(self, event: Event) -> bool:
        from trainguard.schemas.codec import encode

        with self._lock:
            try:
                if self.sock is None:
                    raise OSError(self.errno, self.error or "no socket")
                self.sock.sendto(encode(event), self.path)
            except OSError as exc:  # no exporter, a stale socket, its queue full
                self.failures += 1
                self.errno, self.error = exc.errno or 0, exc.strerror or str(exc)
                return False
            self.sent += 1
            return True

    def close(self) -> None:
        with self._lock:
            if self.sock is not None:
                self.sock.close()
                self.sock = None


class Registration:
    """Registers the rank with the node exporter now and every ``interval_s`` (on a thread); a
    failed send is retried from :data:`REGISTER_RETRY_S`, doubling up to ``interval_s``."""

    def __init__(self, link: ExporterLink, plan: LaunchPlan, pid: int, interval_s: float) -> None:
        from trainguard.schemas.workload import RankRegistration

        self.link, self.interval_s = link, interval_s
        self.event = RankRegistration(
            job=plan.job,
            node=plan.node,
            rank=plan.rank,
            local_rank=plan.local_rank,
            pid=pid,
            launcher_pid=os.getpid(),
            ts_ms=now_ms(),
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainguard-launch-register", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)

    def _run(self) -> None:
        backoff = Backoff(initial_s=REGISTER_RETRY_S, max_s=self.interval_s, jitter=0.2)
        failing = False
        while not self._stop.is_set():
            if self.link.send(self.event):
                if failing:
                    say(f"rank {self.event.rank} registered with the node exporter at {self.link.path}")
                failing = False
                backoff.reset()
                delay = self.interval_s
            else:
                if not failing:  # said once per outage: a rank without exporter trains on quietly
                    say(
                        f"node exporter not reachable at {self.link.path} ({self.link.error}): "
                        f"rank {self.event.rank} not registered yet; retrying"
                    )
                failing = True
                delay = backoff.next_delay()
            self._stop.wait(delay)


def exit_event(plan: LaunchPlan, pid: int, returncode: int, ts_ms: int) -> ProcessExit:
    """The ``ProcessExit`` of the rank's process as its launcher saw it (``returncode`` as
    ``subprocess`` gives it: negative for a signal).

    >>> from types import SimpleNamespace
    >>> plan = SimpleNamespace(job="llm", node="n2", rank=3)
    >>> e = exit_event(plan, 4711, -9, 1_700_000_000_000)
    >>> e.exit_code, e.signal, e.rank, e.role.value, e.reason
    (137, 9, 3, 'main', 'killed by signal 9 (SIGKILL), seen by its launcher')
    >>> exit_event(plan, 4711, 1, 0).reason
    'exited with code 1, seen by its launcher'
    """
    from trainguard.schemas.enums import ProcessRole
    from trainguard.schemas.workload import ProcessExit

    sig = -returncode if returncode < 0 else None
    if sig is not None:
        try:
            name = f" ({signal.Signals(sig).name})"
        except ValueError:
            name = ""
        reason = f"killed by signal {sig}{name}, seen by its launcher"
    else:
        reason = f"exited with code {returncode}, seen by its launcher"
    return ProcessExit(
        node=plan.node,
        ts_ms=ts_ms,
        pid=pid,
        job=plan.job,
        rank=plan.rank,
        role=ProcessRole.MAIN,
        exit_code=exit_code(returncode),
        signal=sig,
        reason=reason,
    )


def report_exit(link: ExporterLink, event: ProcessExit) -> bool:
    """Send the rank's exit; while the exporter's queue is full, retry for :data:`EXIT_REPORT_S`."""
    deadline = time.monotonic() + EXIT_REPORT_S
    while not link.send(event):
        if link.errno not in (errno.EAGAIN, errno.ENOBUFS) or time.monotonic() >= deadline:
            say(f"exit of rank {event.rank} not reported to the node exporter at {link.path}: {link.error}")
            return False
        time.sleep(0.02)
    return True


def write_ready_file(path: str, body: dict[str, Any]) -> None:
    """``body`` as JSON at ``path``, atomically (a reader never sees half a file)."""
    from trainguard.agent.endpoint import write_state  # the agent's state file is written alike

    write_state(Path(path), body)


def signal_ready(plan: LaunchPlan, pid: int, outcome: SpecOutcome) -> None:
    click.echo(f"{PREFIX} job {plan.job} rank {plan.rank} on {plan.node} ready")
    if not plan.ready_file:
        return
    body = {
        "job": plan.job,
        "slurm_job_id": plan.slurm_job_id,
        "step_id": plan.step_id,
        "rank": plan.rank,
        "local_rank": plan.local_rank,
        "node": plan.node,
        "world_size": plan.world_size,
        "master_addr": plan.master_addr,
        "master_port": plan.master_port,
        "master_from": plan.master_from,
        "pid": pid,
        "ts_ms": now_ms(),
        "spec": asdict(outcome),
    }
    try:
        write_ready_file(plan.ready_file, body)
    except OSError as exc:  # a bad path must not stop the training
        say(f"ERROR: ready file {plan.ready_file} not written: {exc}")


def exit_code(returncode: int) -> int:
    """A child's exit status as a shell reports it: its code, or 128 + the signal that killed it.

    >>> exit_code(3), exit_code(-15), exit_code(-9)
    (3, 143, 137)
    """
    return 128 - returncode if returncode < 0 else returncode


def agent_options(plan: LaunchPlan, cfg: LaunchConfig, command: list[str]) -> dict[str, Any]:
    """The :class:`~trainguard.agent.config.AgentConfig` of this task's agent: its rank's world
    from Slurm, generation ``TRAINGUARD_RESTART`` (0 for the job's own launch)."""
    from trainguard.launch_env import LaunchError, fill_path

    fill = {
        "job_id": plan.slurm_job_id,
        "step_id": plan.step_id,
        "node": plan.node,
        "rank": plan.rank,
        "local_rank": plan.local_rank,
    }
    try:
        state_dir = fill_path("--agent-state-dir", cfg.agent_state_dir, fill)
    except LaunchError as exc:
        raise click.UsageError(str(exc)) from None
    return {
        "job": plan.job,
        "node": plan.node,
        "command": command,
        "ranks_per_node": plan.topology.ranks_per_machine,
        "local_ranks": [plan.local_rank],
        "preload": list(cfg.agent_preload),
        "state_dir": state_dir,
        "port": cfg.agent_port + plan.local_rank if cfg.agent_port else 0,
        "code_root": cfg.agent_code_root,
        "nodes": list(plan.topology.machines),
        "generation": plan.restart,
        "master_addr": plan.master_addr,
        "master_port": plan.master_port,
        "reporter_socket": plan.reporter_socket,
        "register_interval_s": cfg.register_interval_s,
    }


def run_as_agent(ctx: click.Context, plan: LaunchPlan, cfg: LaunchConfig, command: list[str]) -> None:
    """The task as a warm node agent: rank 0 still publishes the spec (in the background)."""
    from trainguard.commands.agent import run_agent

    if plan.publishes:
        threading.Thread(
            target=publish_spec,
            args=(plan, ctx, cfg.publish_timeout_s),
            name="trainguard-launch-publish",
            daemon=True,
        ).start()
    say(f"job {plan.job} rank {plan.rank} on {plan.node}: warm node agent")
    run_agent(ctx, agent_options(plan, cfg, command), base_env=plan.child_env())


def _option_error(message: str) -> str:
    """A config error in the options' words: ``LaunchConfig.publish_timeout_s: ...`` ->
    ``--publish-timeout: ...``."""
    m = re.match(r"LaunchConfig(?:\.(\w+))?: ", message)
    if m is None:
        return message
    name = _OPTION_NAMES.get(m.group(1) or "", "--" + (m.group(1) or "").replace("_", "-"))
    return f"{name}: {message[m.end() :]}" if m.group(1) else message[m.end() :]


_OPTION_NAMES = {"publish_timeout_s": "--publish-timeout", "register_interval_s": "--register-interval"}


@click.command("launch", context_settings={"allow_interspersed_args": False})
@click.option("--job", required=True, help="The TrainGuard job name.")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor parallel size.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline parallel size.")
@click.option("--dp", type=int, default=0, help="Data parallel size (default: tasks / (tp * pp)).")
@click.option("--order", default="tp-dp-pp", show_default=True, help="Rank order, fastest dimension first.")
@click.option(
    "--master-addr",
    default="",
    help="Rendezvous host (default: rank 0's node: its name when it resolves, else its Slurm NodeAddr).",
)
@click.option(
    "--master-port", type=int, default=0, help="Rendezvous port (default: 20000 + Slurm job id % 10000)."
)
@click.option(
    "--reporter-socket",
    default="",
    help="The node exporter's reporter socket (default: $TRAINGUARD_REPORTER_SOCKET or "
    "/run/trainguard/reporter.sock). May hold {node}, {job_id}, {step_id}, {rank}, {local_rank}.",
)
@click.option(
    "--register-interval",
    "register_interval_s",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds between registrations of the rank with the node exporter (at that socket).",
)
@click.option(
    "--ready-file", default="", help="Write this JSON file once ready (same placeholders as above)."
)
@click.option("--publish/--no-publish", default=True, help="Rank 0 publishes the job spec (default: yes).")
@click.option(
    "--publish-timeout",
    "publish_timeout_s",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds rank 0 keeps trying to publish the spec (training runs meanwhile).",
)
@click.option(
    "--topology-conf",
    default="",
    help="Slurm's topology.conf, for the nodes' network positions in the job spec "
    "(default: beside $SLURM_CONF or /etc/slurm/slurm.conf; absent: no positions).",
)
@click.option(
    "--topology-pod-level",
    type=int,
    default=1,
    show_default=True,
    help="A node's pod is the switch this many levels above its rack's.",
)
@click.option(
    "--agent/--no-agent", default=False, help="Run the task as a warm node agent (trainguard agent)."
)
@click.option("--agent-preload", multiple=True, help="Modules the agent's zygote imports (comma-separated).")
@click.option("--agent-port", type=int, default=9403, show_default=True, help="Agent port + local rank.")
@click.option(
    "--agent-state-dir",
    default="/run/trainguard/agent/{job_id}/{local_rank}",
    show_default=True,
    help="The agent's state file and logs (same placeholders as --ready-file).",
)
@click.option("--agent-code-root", default="", help="Code version V lives in AGENT_CODE_ROOT/V.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def launch(ctx: click.Context, command: tuple[str, ...], **options: Any) -> None:
    """Run one Slurm task of a training job: CMD with its rank's environment; rank 0 publishes the
    job spec.  Use after srun: srun trainguard launch --job J --tp 8 -- python train.py"""
    # Here, not at the top: every `trainguard` command would pay for the Slurm parsing imports.
    from trainguard.launch_env import LaunchConfig, LaunchError, find_master, plan_launch, read_positions

    if not command:
        raise click.UsageError("give the training command after --: trainguard launch --job J -- CMD ARGS...")
    options["agent_preload"] = [m for item in options["agent_preload"] for m in item.split(",") if m]
    try:
        cfg = load_config(LaunchConfig, options)
    except ConfigError as exc:
        raise click.UsageError(_option_error(str(exc))) from None
    try:
        plan = plan_launch(cfg, os.environ)
    except LaunchError as exc:
        raise click.ClickException(f"{PREFIX} {exc}") from None
    plan = find_master(plan, cfg, os.environ)
    if plan.publishes:  # only the spec needs them: rank 0 reads the file, not every task
        plan, note = read_positions(plan, cfg, os.environ)
        if note:
            say(note)
    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        # kafka-python logs every refused connection; the launcher says once what failed.
        logging.getLogger("kafka").setLevel(logging.CRITICAL)
    forwarder = Forwarder()
    forwarder.install()
    if plan.rank == 0:
        t = plan.topology
        say(
            f"job {plan.job}: Slurm job {plan.slurm_job_id} step {plan.step_id}, {plan.world_size} ranks "
            f"(tp{t.tp} pp{t.pp} dp{t.dp}, {t.ranks_per_machine} per node) on {','.join(t.machines)}, "
            f"standbys {','.join(plan.standbys) or 'none'}, master {plan.master_addr}:{plan.master_port}"
        )
        say(f"master address {plan.master_addr}: {plan.master_from}")
    if cfg.agent:
        run_as_agent(ctx, plan, cfg, list(command))
        return
    try:
        child = subprocess.Popen(list(command), env={**os.environ, **plan.child_env()})
    except FileNotFoundError:
        say(f"{command[0]}: command not found")
        ctx.exit(127)
    except OSError as exc:
        say(f"{command[0]}: {exc.strerror or exc}")
        ctx.exit(126)
    forwarder.attach(child)
    link = ExporterLink(plan.reporter_socket)
    registration = Registration(link, plan, child.pid, cfg.register_interval_s)
    registration.start()
    publisher: threading.Thread | None = None
    if plan.publishes:

        def publish_then_ready() -> None:
            signal_ready(plan, child.pid, publish_spec(plan, ctx, cfg.publish_timeout_s))

        publisher = threading.Thread(target=publish_then_ready, name="trainguard-launch-publish", daemon=True)
        publisher.start()
    else:
        if plan.rank == 0 and plan.publish and plan.restart:
            say(f"step restarted by the action service (TRAINGUARD_RESTART={plan.restart}): its spec stands")
        signal_ready(plan, child.pid, SpecOutcome())
    returncode = child.wait()
    ended_ms = now_ms()
    forwarder.ignore()
    registration.stop()
    report_exit(link, exit_event(plan, child.pid, returncode, ended_ms))
    link.close()
    code = exit_code(returncode)
    if publisher is not None and publisher.is_alive():
        publisher.join(EXIT_GRACE_S)
        if publisher.is_alive():
            say(f"training exited before the job spec of {plan.job} was published; giving up on it")
    ctx.exit(code)


COMMANDS: list[click.Command] = [launch]
