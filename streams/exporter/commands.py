"""Follows the node's command topic (``trainguard.control.commands``, keyed by node).

Commands: ``capture_stacks`` (``args: {"rounds": N, "interval_s": S[, "first_round": K]}``: py-spy
every training process N times, S seconds apart, numbering the rounds from K (0) -- one round for
a hang, several for fail-slow, more for a close fail-slow vote, §5) and
``set_interval`` (``args: {"source": NAME, "interval_s": S}``).  Each exporter is the only member
of its own consumer group (``trainguard-exporter.<node>``), so it sees every partition and keeps
its offsets across restarts; commands for other nodes or jobs, and commands older than
``max_age_s`` (a restart must not replay yesterday's capture), are skipped.  A bad command is
logged and counted in the heartbeat, never fatal: each record is handled in its own ``try``; one
addressed to this node whose handling raises (malformed arguments, a bug) is dead-lettered at
stage ``exporter:command`` and the listener commits past it.  Undecodable records are only
logged and counted here (every exporter reads every command; the workers' sink dead-letters
garbage once).  Only the broker being away makes the listener reconnect (with a backoff) and
read again from its committed offsets.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from trainguard.infra.backoff import Backoff
from trainguard.infra.bus import EventProducer, authentic, coordinates, decode_record, offsets_at, poisoned
from trainguard.infra.config import KafkaConfig
from trainguard.infra.signing import AuthError, Verifier, may_order, signer_principal
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import Command, DeadLetter
from trainguard.schemas.telemetry import SourceHealth
from trainguard.schemas.topics import COMMANDS, DEAD_LETTERS
from trainguard.streams.exporter.config import CommandsConfig

log = logging.getLogger(__name__)

#: a command older than this when it arrives is logged (the worker or the broker was slow).
SLOW_DELIVERY_S = 1.0


def skip_reason(cmd: Command, node: str, job: str, now: int, max_age_s: float) -> str:
    """Why this exporter ignores ``cmd`` ("" = it applies).

    >>> from trainguard.schemas.control import CommandKind
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


def first_round_of(args: dict[str, Any], max_rounds: int) -> int:
    """The number of a capture command's first round (0; more when the worker asks a capture
    for more rounds); ValueError if malformed.

    >>> first_round_of({}, 100), first_round_of({"first_round": 5}, 100)
    (0, 5)
    """
    first = _number(args, "first_round", 0, 0, max_rounds)
    if first != int(first):
        raise ValueError(f"first_round must be an integer, got {first}")
    return int(first)


def interval_args(args: dict[str, Any]) -> tuple[str, float]:
    """(source, interval_s) of a set_interval command; ValueError if malformed."""
    source = args.get("source")
    if not isinstance(source, str) or not source:
        raise ValueError(f"source must be a source name, got {source!r}")
    return source, _number(args, "interval_s", None, 0.01, 86_400)


#: the stage of the dead letters for commands this exporter failed to handle.
STAGE = "exporter:command"


class CommandListener:
    """A thread consuming commands for this node and handing them to ``handle``.

    ``dead_letter`` publishes the dead letter of a command whose handling failed (default: to
    the dead-letter topic through a producer of the listener's own, opened on first use)."""

    def __init__(
        self,
        kafka: KafkaConfig,
        node: str,
        job: str,
        cfg: CommandsConfig,
        handle: Callable[[Command], None],
        dead_letter: Callable[[DeadLetter], None] | None = None,
        verifier: Verifier | None = None,
    ) -> None:
        self.kafka, self.node, self.job, self.cfg, self.handle = kafka, node, job, cfg, handle
        #: a command whose signature fails is dead-lettered (stage ``auth``), never run.
        self.verifier = verifier
        self._publish_dead_letter = dead_letter
        self._producer: EventProducer | None = None
        #: set once the consumer owns its partitions and knows where it starts reading.
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.handled = 0
        #: commands dead-lettered (handling failed) since the start.
        self.dead_lettered = 0
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
        if self._producer is not None:
            try:
                self._producer.close(timeout_s=2.0)
            except Exception as exc:
                log.debug("closing the dead-letter producer: %s", exc)
            self._producer = None

    def _fail(self, text: str, error: bool = False) -> None:
        self.errors += 1
        self.last_error = text
        log.log(logging.ERROR if error else logging.WARNING, "commands: %s", text)

    def _consumer(self) -> Any:
        from kafka import KafkaConsumer

        return KafkaConsumer(
            COMMANDS.name,
            **self.kafka.client_kwargs(),
            group_id=f"trainguard-exporter.{self.node}",
            # A node's first start reads from now on; later starts resume at their offsets.
            auto_offset_reset="latest",
            # Committed after each batch is handled (dead-lettered records included).
            enable_auto_commit=False,
            session_timeout_ms=10_000,
            heartbeat_interval_ms=2_000,
        )

    def _run(self) -> None:
        consumer: Any = None
        backoff = Backoff(initial_s=1.0, max_s=30.0, jitter=0.5)
        while not self._stop.is_set():
            try:
                if consumer is None:
                    consumer = self._consumer()
                batches = consumer.poll(timeout_ms=500)
                if not self.ready.is_set() and consumer.assignment():
                    self._skip_expired(consumer)  # resolves "latest" too, before we say ready
                    self.ready.set()
                    self.last_ok_ms = now_ms()
                records = [rec for recs in batches.values() for rec in recs]
                for rec in records:
                    self.dispatch(rec)  # never raises: a bad record is dead-lettered
                if records:
                    consumer.commit()  # past every record of the batch, the bad ones included
                backoff.reset()
            except Exception as exc:  # broker away, group errors: reconnect after a pause
                self._fail(f"{type(exc).__name__}: {exc}")
                if consumer is not None:
                    try:
                        consumer.close(autocommit=False)
                    except Exception as close_exc:
                        log.debug("closing command consumer: %s", close_exc)
                    consumer = None
                self.ready.clear()
                self._stop.wait(backoff.next_delay())
        if consumer is not None:
            consumer.close()

    def _skip_expired(self, consumer: Any) -> None:
        """Start no earlier than ``max_age_s`` ago: after an exporter was down for a while its
        committed offsets lie before commands that are all past their age (each would only be
        refused), and reading hours of them would delay the ones that count."""
        parts = list(consumer.assignment())
        try:
            recent = offsets_at(consumer, parts, now_ms() - int(self.cfg.max_age_s * 1000))
        except Exception as exc:  # an old broker without timestamps: read them all, each is checked
            log.info("commands: cannot look up offsets by time (%s): reading from the committed ones", exc)
            recent = {}
        for tp in parts:
            pos = consumer.position(tp)  # resolves "latest" too
            first_recent = recent.get(tp, pos)
            if first_recent > pos:
                log.info("commands: skipping %d command(s) older than %.0f s on %s", first_recent - pos,
                         self.cfg.max_age_s, tp)  # fmt: skip
                consumer.seek(tp, first_recent)

    def dispatch(self, rec: Any) -> None:
        """Handle one consumed record; never raises (a failure is dead-lettered, see module doc)."""
        try:
            self._dispatch(rec)
        except Exception as exc:
            self._reject(rec, exc)

    def _dispatch(self, rec: Any) -> None:
        why = authentic(self.verifier, rec)
        if why:
            raise AuthError(f"not authentic: {why}")  # dead-lettered by dispatch
        cmd = decode_record(rec)
        if isinstance(cmd, DeadLetter):
            self._fail(f"undecodable command at {coordinates(rec)}: {cmd.reason}", error=True)
            return
        if not isinstance(cmd, Command):
            self._fail(f"not a command at {coordinates(rec)}: {cmd.TYPE}", error=True)
            return
        principal = signer_principal(self.verifier, getattr(rec, "headers", None))
        if principal and not may_order(principal, cmd.kind.value):
            why = f"key of principal {principal} may not order a {cmd.kind.value} command"
            raise AuthError(f"not authentic: {why}")
        why = skip_reason(cmd, self.node, self.job, now_ms(), self.cfg.max_age_s)
        if why:
            log.debug("command %s skipped: %s", cmd.command_id, why)
            return
        late_s = (now_ms() - cmd.ts_ms) / 1000
        if late_s > SLOW_DELIVERY_S:  # a capture that starts late delays a hang's verdict as much
            log.warning(
                "command %s (%s) arrived %.1f s after it was sent", cmd.command_id, cmd.kind.value, late_s
            )
        self.handle(cmd)  # raising (ValueError: malformed): dead-lettered by dispatch
        self.handled += 1
        self.last_ok_ms = now_ms()
        self.last_error = ""

    def _reject(self, rec: Any, exc: Exception) -> None:
        dl = poisoned(rec, STAGE, exc, log)
        self.dead_lettered += 1
        self.errors += 1
        self.last_error = f"command at {coordinates(rec)} dead-lettered: {type(exc).__name__}: {exc}"
        try:
            if self._publish_dead_letter is not None:
                self._publish_dead_letter(dl)
            else:
                if self._producer is None:
                    self._producer = EventProducer(self.kafka, linger_ms=0)
                self._producer.send(dl, DEAD_LETTERS)
                self._producer.flush(5.0)
        except Exception as pub_exc:  # logged above with its coordinates; skipped either way
            log.warning("commands: could not publish the dead letter for %s: %s", coordinates(rec), pub_exc)
