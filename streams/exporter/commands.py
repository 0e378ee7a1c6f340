"""Follows the node's command topic (``trainguard.control.commands``, keyed by node).

Commands: ``capture_stacks`` (``args: {"rounds": N, "interval_s": S}``: py-spy every training
process N times, S seconds apart -- one round for a hang, several for fail-slow, §5) and
``set_interval`` (``args: {"source": NAME, "interval_s": S}``).  Each exporter is the only member
of its own consumer group (``trainguard-exporter.<node>``), so it sees every partition and keeps
its offsets across restarts; commands for other nodes or jobs, and commands older than
``max_age_s`` (a restart must not replay yesterday's capture), are skipped.  A bad command is
logged and counted in the heartbeat, never fatal.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from infra.bus import decode_record
from infra.config import KafkaConfig
from schemas.base import now_ms
from schemas.control import Command, DeadLetter
from schemas.telemetry import SourceHealth
from schemas.topics import COMMANDS
from streams.exporter.config import CommandsConfig

log = logging.getLogger(__name__)


def skip_reason(cmd: Command, node: str, job: str, now: int, max_age_s: float) -> str:
    """Why this exporter ignores ``cmd`` ("" = it applies).

    >>> from schemas.control import CommandKind
    >>> c = Command(command_id="c1", ts_ms=1000, kind=CommandKind.CAPTURE_STACKS, node="n1")
    >>> skip_reason(c, "n1", "j", 2000, 60), skip_reason(c, "n2", "j", 2000, 60)
    ('', 'for node n1')
    >>> skip_reason(c, "n1", "j", 70_000, 60)
    'stale (69.0 s old)'
    """
    if cmd.node and cmd.node != node:
        return f"for node {cmd.node}"
    if cmd.job and job and cmd.job != job:
        return f"for job {cmd.job}"
    age = (now - cmd.ts_ms) / 1000
    if age > max_age_s:
        return f"stale ({age:.1f} s old)"
    return ""


def _number(args: dict[str, Any], name: str, default: float | None, lo: float, hi: float) -> float:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} outside [{lo}, {hi}]")
    return float(value)


def capture_id_of(cmd_id: str, args: dict[str, Any]) -> str:
    """The capture a capture command belongs to: ``args.capture_id``, shared by the commands sent
    to every machine of the job (the aggregator joins their dumps on it); else the command's id.

    >>> capture_id_of("c1", {}), capture_id_of("c1", {"capture_id": "cap9"})
    ('c1', 'cap9')
    """
    cid = args.get("capture_id", cmd_id)
    if not isinstance(cid, str) or not cid:
        raise ValueError(f"capture_id must be a non-empty string, got {cid!r}")
    return cid


def capture_args(args: dict[str, Any], max_rounds: int) -> tuple[int, float]:
    """(rounds, interval_s) of a capture command; ValueError if malformed.

    >>> capture_args({}, 100), capture_args({"rounds": 5, "interval_s": 10}, 100)
    ((1, 0.0), (5, 10.0))
    """
    rounds = _number(args, "rounds", 1, 1, max_rounds)
    if rounds != int(rounds):
        raise ValueError(f"rounds must be an integer, got {rounds}")
    return int(rounds), _number(args, "interval_s", 0.0, 0.0, 3600.0)


def interval_args(args: dict[str, Any]) -> tuple[str, float]:
    """(source, interval_s) of a set_interval command; ValueError if malformed."""
    source = args.get("source")
    if not isinstance(source, str) or not source:
        raise ValueError(f"source must be a source name, got {source!r}")
    return source, _number(args, "interval_s", None, 0.01, 86_400)


class CommandListener:
    """A thread consuming commands for this node and handing them to ``handle``."""

    def __init__(
        self,
        kafka: KafkaConfig,
        node: str,
        job: str,
        cfg: CommandsConfig,
        handle: Callable[[Command], None],
    ) -> None:
        self.kafka, self.node, self.job, self.cfg, self.handle = kafka, node, job, cfg, handle
        #: set once the consumer owns its partitions and knows where it starts reading.
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.handled = 0
        self.errors = 0
        self.last_error = ""
        self.last_ok_ms = 0

    def health(self) -> SourceHealth:
        return SourceHealth(
            name="commands",
            ok=self.ready.is_set() and not self.last_error,
            last_success_ms=self.last_ok_ms,
            error_count=self.errors,
            last_error=self.last_error[:4096],
        )

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="commands", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _fail(self, text: str) -> None:
        self.errors += 1
        self.last_error = text
        log.warning("commands: %s", text)

    def _consumer(self) -> Any:
        from kafka import KafkaConsumer

        return KafkaConsumer(
            COMMANDS.name,
            **self.kafka.client_kwargs(),
            group_id=f"trainguard-exporter.{self.node}",
            # A node's first start reads from now on; later starts resume at their offsets.
            auto_offset_reset="latest",
            enable_auto_commit=True,
            auto_commit_interval_ms=1000,
            session_timeout_ms=10_000,
            heartbeat_interval_ms=2_000,
        )

    def _run(self) -> None:
        consumer: Any = None
        while not self._stop.is_set():
            try:
                if consumer is None:
                    consumer = self._consumer()
                batches = consumer.poll(timeout_ms=500)
                if not self.ready.is_set() and consumer.assignment():
                    for tp in consumer.assignment():
                        consumer.position(tp)  # resolves "latest" now, before we say ready
                    self.ready.set()
                    self.last_ok_ms = now_ms()
                for records in batches.values():
                    for rec in records:
                        self._dispatch(rec)
            except Exception as exc:  # broker away, group errors: reconnect after a pause
                self._fail(f"{type(exc).__name__}: {exc}")
                if consumer is not None:
                    try:
                        consumer.close(autocommit=False)
                    except Exception as close_exc:
                        log.debug("closing command consumer: %s", close_exc)
                    consumer = None
                self.ready.clear()
                self._stop.wait(2.0)
        if consumer is not None:
            consumer.close()

    def _dispatch(self, rec: Any) -> None:
        cmd = decode_record(rec)
        if isinstance(cmd, DeadLetter):
            self._fail(f"undecodable command at offset {rec.offset}: {cmd.reason}")
            return
        if not isinstance(cmd, Command):
            self._fail(f"not a command: {cmd.TYPE}")
            return
        why = skip_reason(cmd, self.node, self.job, now_ms(), self.cfg.max_age_s)
        if why:
            log.debug("command %s skipped: %s", cmd.command_id, why)
            return
        try:
            self.handle(cmd)
        except ValueError as exc:
            self._fail(f"command {cmd.command_id} ({cmd.kind}) rejected: {exc}")
            return
        self.handled += 1
        self.last_ok_ms = now_ms()
        self.last_error = ""
