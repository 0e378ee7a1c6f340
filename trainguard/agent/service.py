"""The warm node agent: stays resident for the job's life, holds a zygote, and restarts its ranks in
place on a signed command.

States (``state`` in the document :meth:`NodeAgent.snapshot` gives):

* ``starting`` -- the zygote is importing the preload list;
* ``warm`` -- the zygote is ready and no rank runs here (a standby, or between generations);
* ``restarting`` -- a restart is under way (an urgent hot update may wait for its zygote's imports);
* ``running`` -- this machine's ranks of ``generation`` run;
* ``gone`` -- the agent stopped (written last; a state file whose ``pid`` is dead means the same).

``warm`` (a separate flag) says whether the warm path is there *now*: the zygote is alive and has
imported everything.  A zygote that dies makes it false at once -- the executor then takes the
cold path -- and the agent starts a fresh zygote in the background.

Commands come through :class:`~trainguard.streams.exporter.commands.CommandListener`, the
exporters' own signed path: from the Kafka command topic (a consumer group per agent) and from
``POST /command`` (:mod:`trainguard.agent.endpoint`), both checked by one verifier.  A forged,
tampered, expired or replayed command is dead-lettered (stage ``exporter:command``, to
``<state_dir>/dead-letters.jsonl`` and, with Kafka, the dead-letter topic) and never acted on.  A
restart for a generation that is not newer than the current one is ignored (idempotent).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from trainguard.agent.config import AgentConfig
from trainguard.agent.endpoint import Endpoint, write_state
from trainguard.agent.reports import RankReports
from trainguard.agent.world import World, check_version, entry_of, judge, rank_env, world_of
from trainguard.agent.zygote_client import Zygote, ZygoteError
from trainguard.infra.backoff import Backoff
from trainguard.infra.config import KafkaConfig
from trainguard.infra.signing import Verifier
from trainguard.schemas.base import now_ms
from trainguard.schemas.codec import encode
from trainguard.schemas.control import AGENT_KINDS, Command, CommandKind, DeadLetter
from trainguard.schemas.topics import COMMANDS
from trainguard.streams.exporter.commands import CommandListener
from trainguard.streams.exporter.config import CommandsConfig

log = logging.getLogger(__name__)


class AgentListener(CommandListener):
    """The exporters' listener in its own consumer group: an agent sees every command too."""

    def __init__(self, *args: Any, group: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    def _consumer(self) -> Any:
        from kafka import KafkaConsumer

        return KafkaConsumer(
            COMMANDS.name,
            **self.kafka.client_kwargs(),
            group_id=self.group,
            auto_offset_reset="latest",
            enable_auto_commit=False,
            session_timeout_ms=10_000,
            heartbeat_interval_ms=2_000,
        )


class NodeAgent:
    """One machine's (or one Slurm task's) warm agent; see the module docstring."""

    def __init__(self, cfg: AgentConfig, verifier: Verifier | None, kafka: KafkaConfig | None = None) -> None:
        self.cfg = cfg
        self.state_dir = Path(cfg.state_dir)
        self.entry = entry_of(cfg.command)
        self.base_env = dict(os.environ)
        self._lock = threading.RLock()  # one command at a time; state changes under it
        self._stop = threading.Event()
        self.state = "starting"
        self.generation = cfg.generation
        self.world: World | None = None
        self.code_version = check_version(cfg.code_version)
        #: a lazy hot update waiting for the next restart, and its pre-warmed zygote.
        self.pending_version = ""
        self._pending_zygote: Zygote | None = None
        self.ranks: dict[int, dict[str, Any]] = {}  # local rank -> {pid, rank, code}
        self.last: dict[str, Any] = {}  # the last command's outcome
        self.restarts: list[dict[str, Any]] = []
        self._outcome: tuple[str, str] = ("skipped", "")
        self._exits: dict[int, int] = {}  # pid -> exit code of ranks that ended
        self._pid_rank: dict[int, int] = {}  # pid -> rank, of every rank forked and not yet ended
        self._stopping: set[int] = set()  # pids the agent is stopping itself (not reported)
        self._exits_lock = threading.Lock()
        self._dirty = threading.Event()
        self.zygote = self._spawn(self.code_version)
        from trainguard.streams.reporter import DEFAULT_SOCKET

        socket_path = (
            cfg.reporter_socket or os.environ.get("TRAINGUARD_REPORTER_SOCKET", "") or DEFAULT_SOCKET
        )
        self.reports = RankReports(socket_path, cfg.job, cfg.node)
        self.listener = AgentListener(
            kafka or KafkaConfig(),
            cfg.node,
            cfg.job,
            CommandsConfig(max_age_s=cfg.max_age_s),
            self.handle,
            dead_letter=self._dead_letter,
            verifier=verifier,
            group=f"trainguard-agent.{cfg.node}.{'-'.join(map(str, cfg.held))}",
        )
        self._http_seq = 0
        self._last_doc: dict[str, Any] = {}
        self._respawn_backoff = Backoff(initial_s=1.0, max_s=60.0, jitter=0.2)
        self.endpoint = Endpoint(cfg.host, cfg.port, self._state_for_http, self._submit_http)

    # --- zygotes -----------------------------------------------------------------------------------

    def _code_dir(self, version: str) -> str:
        return str(Path(self.cfg.code_root) / version) if version else ""

    def _spawn(self, version: str) -> Zygote:
        return Zygote(
            self.cfg.preload,
            self._code_dir(version),
            self.state_dir / "logs" / f"zygote-{version or 'base'}.log",
            self.base_env,
            self._on_rank_exit,
        )

    def _on_rank_exit(self, pid: int, code: int) -> None:
        # On the zygote's reader thread, which must never wait for the agent's lock: a restart
        # holds it while it waits for that very thread to deliver the zygote's fork replies.
        with self._exits_lock:
            self._exits[pid] = code
            rank = self._pid_rank.pop(pid, None)
            deliberate = pid in self._stopping
            self._stopping.discard(pid)
        if rank is not None and not deliberate:
            self.reports.exited(rank, pid, code)
        self._dirty.set()  # the main loop rewrites the state file

    def _zygote_for(self, version: str) -> Zygote:
        """The zygote of ``version``, warm: the current one, the pre-warmed one of a lazy update,
        or a new one (an urgent update to a version nobody announced pays the imports here)."""
        if version == self.code_version:
            z = self.zygote
            if not z.warm:  # say so at once: the executor takes the cold path, never waits here
                raise ZygoteError(
                    f"zygote of code version {version or 'base'} not warm: {z.error or 'starting'}"
                )
        elif self._pending_zygote is not None and self.pending_version == version:
            z, self._pending_zygote = self._pending_zygote, None
        else:
            z = self._spawn(version)
        if not z.wait_ready(self.cfg.zygote_timeout_s):
            raise ZygoteError(f"zygote of code version {version or 'base'} not warm: {z.error}")
        if z is not self.zygote:
            self.zygote.stop()
            self.zygote, self.code_version = z, version
        if self.pending_version == version:
            self.pending_version = ""
        return z

    # --- commands ----------------------------------------------------------------------------------

    def handle(self, cmd: Command) -> None:
        """Act on one authentic command for this node (ValueError: malformed; ZygoteError: the warm
        path is not there -- both dead-lettered by the listener, the executor goes cold)."""
        if cmd.kind not in AGENT_KINDS:
            return  # the exporter's
        if cmd.job != self.cfg.job:  # a command without a job must not restart every job's ranks
            raise ValueError(f"command for job {cmd.job!r}, this agent runs {self.cfg.job!r}")
        with self._lock:
            if cmd.kind is CommandKind.AGENT_CODE:
                self._lazy_update(check_version(cmd.args.get("code_version")))
                self._outcome = ("done", f"code version {self.pending_version or self.code_version} next")
            else:
                self._outcome = self.restart(world_of(cmd.args))
            self.last = {
                "command_id": cmd.command_id,
                "outcome": self._outcome[0],
                "detail": self._outcome[1],
            }
            self._publish()

    def _lazy_update(self, version: str) -> None:
        if version in (self.code_version, self.pending_version):
            return
        if self._pending_zygote is not None:
            self._pending_zygote.stop()
        # Pre-warmed now, so the restart that takes it is as warm as any other.
        self.pending_version, self._pending_zygote = version, self._spawn(version)

    def restart(self, world: World) -> tuple[str, str]:
        """Restart this agent's ranks on ``world``: (outcome, detail)."""
        started = time.monotonic()
        verdict = judge(world, self.generation, self.cfg.node)
        if verdict == "stale":
            return "ignored", f"generation {world.generation} is not newer than {self.generation}"
        version = world.code_version or self.pending_version or self.code_version
        previous, self.state = self.state, "restarting"
        self._publish()
        try:
            zygote = self._zygote_for(version)
        except ZygoteError:
            self.state = previous
            raise  # before stopping anything: a failure leaves ranks up
        self._stop_ranks()
        self.generation, self.world, self.state = world.generation, world, "warm"
        if verdict == "standby":
            return "done", f"generation {world.generation}: standby (not among the job's machines)"
        for local in self.cfg.held:
            env = {
                **self.base_env,
                **rank_env(world, self.cfg.node, local, self.cfg.ranks_per_node, self.cfg.job),
            }
            if version:
                env["TRAINGUARD_CODE_VERSION"] = version
                code_dir = self._code_dir(version)
                env["PYTHONPATH"] = os.pathsep.join(p for p in (code_dir, env.get("PYTHONPATH", "")) if p)
            log_path = self.state_dir / "logs" / f"gen{world.generation}-rank{env['RANK']}.log"
            pid = zygote.fork(f"g{world.generation}-l{local}", env, self.entry, log_path)
            self.ranks[local] = {"pid": pid, "rank": int(env["RANK"])}
            with self._exits_lock:
                self._pid_rank[pid] = int(env["RANK"])
            self.reports.register(int(env["RANK"]), local, pid)
        self.state = "running"
        took = round(time.monotonic() - started, 3)
        self.restarts.append({"generation": world.generation, "fork_s": took, "code_version": version})
        return "done", f"generation {world.generation}: {len(self.cfg.held)} rank(s) forked in {took}s"

    def _stop_ranks(self) -> None:
        """SIGTERM each rank's process group, SIGKILL what is left after ``stop_grace_s``."""
        live = [info["pid"] for info in self.ranks.values()]
        with self._exits_lock:
            self._stopping.update(live)
        for pid in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.stop_grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in live):
            time.sleep(0.01)
        for pid in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        self.ranks.clear()
        with self._exits_lock:
            for pid in live:
                self._exits.pop(pid, None)

    def _submit_http(self, body: bytes, headers: list[tuple[str, bytes]]) -> tuple[int, dict[str, Any]]:
        """One ``POST /command``, through the listener like a Kafka record: its coordinates
        (partition -1, a fresh offset) are never reused, so a second sighting is a replay."""
        if self.listener.verifier is None:
            return 403, {"outcome": "refused", "reason": "commands over HTTP need signing enabled"}
        with self._lock:
            self._http_seq += 1
            rec = SimpleNamespace(
                topic=COMMANDS.name,
                partition=-1,
                offset=self._http_seq,
                key=self.cfg.node.encode(),
                value=body,
                headers=headers,
                timestamp=now_ms(),
            )
            errors = self.listener.errors
            self._outcome = ("skipped", "not for this agent (node, job or age)")
            self.listener.dispatch(rec)  # never raises; a refusal is dead-lettered
            if self.listener.errors != errors:
                return 403, {"outcome": "refused", "reason": self.listener.last_error}
            outcome, detail = self._outcome
        return 200, {"outcome": outcome, "detail": detail, "generation": self.generation}

    def _dead_letter(self, dl: DeadLetter) -> None:
        path = self.state_dir / "dead-letters.jsonl"
        with open(path, "ab") as fh:
            fh.write(encode(dl) + b"\n")
        if self.cfg.kafka:  # on a thread: a broker away must not hold up the refusal
            threading.Thread(target=self._publish_dead_letter, args=(dl,), daemon=True).start()

    def _publish_dead_letter(self, dl: DeadLetter) -> None:
        from trainguard.infra.bus import EventProducer
        from trainguard.schemas.topics import DEAD_LETTERS

        try:
            producer = EventProducer(self.listener.kafka, linger_ms=0)
            try:
                producer.send(dl, DEAD_LETTERS)
                producer.flush(5.0)
            finally:
                producer.close(timeout_s=2.0)
        except Exception as exc:  # written to dead-letters.jsonl already
            log.warning("agent: dead letter not published to Kafka: %s", exc)

    # --- state -------------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        with self._exits_lock:
            exits = dict(self._exits)
        with self._lock:
            return {
                "job": self.cfg.job,
                "node": self.cfg.node,
                "pid": os.getpid(),
                "port": self.endpoint.port,
                "state": self.state,
                "warm": self.zygote.warm,
                "zygote": {
                    "pid": self.zygote.pid,
                    "import_s": self.zygote.import_s,
                    "error": self.zygote.error,
                },
                "generation": self.generation,
                "nodes": list(self.world.nodes) if self.world else [],
                "code_version": self.code_version,
                "pending_code_version": self.pending_version,
                "ranks": [
                    {"local_rank": k, **v, "exit_code": exits.get(v["pid"])}
                    for k, v in sorted(self.ranks.items())
                ],
                "last_command": self.last,
                "refused": self.listener.dead_lettered,
                "restarts": self.restarts[-20:],
                "ts_ms": now_ms(),
            }

    def _state_for_http(self) -> tuple[dict[str, Any], bool]:
        # A restart holds the lock for as long as an urgent update's imports take: the executor
        # asking meanwhile gets the document published last (state "restarting") at once.
        if self._lock.acquire(timeout=0.2):
            try:
                doc = self.snapshot()
            finally:
                self._lock.release()
        else:
            doc = {**self._last_doc, "warm": self.zygote.warm, "ts_ms": now_ms()}
        return doc, bool(doc.get("warm"))

    def _publish(self) -> None:
        self._last_doc = doc = self.snapshot()
        try:
            write_state(self.state_dir / "state.json", doc)
        except OSError as exc:  # a full disk must not stop the ranks; HTTP still answers
            log.warning("agent: state file not written: %s", exc)

    # --- life --------------------------------------------------------------------------------------

    def start(self) -> None:
        self.endpoint.start()
        self._publish()
        if self.cfg.kafka:
            self.listener.start()

    def run(self) -> None:
        """Serve until :meth:`stop`: the first world once warm, a fresh zygote when one dies."""
        self.start()
        first = self.zygote.wait_ready(self.cfg.zygote_timeout_s)
        with self._lock:
            if first and self.cfg.nodes and self.cfg.master_addr:
                nodes, addr, port = tuple(self.cfg.nodes), self.cfg.master_addr, self.cfg.master_port
                self.generation = self.cfg.generation - 1  # so the first world is "newer"
                try:
                    outcome = self.restart(World(self.cfg.generation, nodes, addr, port))
                except ZygoteError as exc:  # died between ready and fork: the loop starts a new one
                    self.generation, outcome = self.cfg.generation, ("refused", str(exc))
                self.last = {"command_id": "", "outcome": outcome[0], "detail": outcome[1]}
            elif first:
                self.state = "warm"
            self._publish()
        registered = time.monotonic()
        while not self._stop.wait(0.2):
            if time.monotonic() - registered >= self.cfg.register_interval_s:
                registered = time.monotonic()
                with self._lock:
                    for local, info in self.ranks.items():
                        self.reports.register(info["rank"], local, info["pid"])
            if self.zygote.dead.is_set():
                self._respawn()
            if self._dirty.is_set():
                self._dirty.clear()
                self._publish()

    def _respawn(self) -> None:
        with self._lock:
            log.warning("agent: zygote died (%s): not warm until a fresh one is", self.zygote.error)
            self._publish()  # warm: false, now
        # A zygote that dies on import would die again at once: wait longer each time.
        if self._stop.wait(self._respawn_backoff.next_delay()):
            return
        with self._lock:
            self.zygote = self._spawn(self.code_version)
        if self.zygote.wait_ready(self.cfg.zygote_timeout_s):
            self._respawn_backoff.reset()
            with self._lock:
                if self.state == "starting":
                    self.state = "warm"
                self._publish()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._stop_ranks()
            self.listener.stop()
            self.zygote.stop()
            if self._pending_zygote is not None:
                self._pending_zygote.stop()
            self.state = "gone"
            self._publish()
            self.reports.close()
        self.endpoint.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie answers kill(0) until its parent reaps it: it has exited, for this purpose.
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False
