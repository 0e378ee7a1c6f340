"""Kafka -> ClickHouse sink: the one loop that stores the registry topics (kafka-python consumer group).

The stream worker runs it in a thread of its own with a consumer group of its own
(``<app_id>-sink``), so a ClickHouse outage never holds up the detection agents; ``trainguard
smoke`` and the tests run the very same :class:`Sink`.

At-least-once: offsets are committed only after every event of the batch is either in ClickHouse
or dead-lettered.  When ClickHouse is away (any failure :class:`~trainguard.infra.clickhouse.store.StoreError`
calls retryable) the loop drops its in-memory copy, rewinds to the committed offsets and waits (the
shared :class:`~trainguard.infra.backoff.Backoff` policy) before reading the batch again: memory stays bounded
however long ClickHouse is down, nothing is lost and the process stays up.  Duplicates from
redelivery collapse in the ReplacingMergeTree tables; on a replicated cluster a batch read again
into the same blocks is also dropped whole by ClickHouse's block deduplication (18.16 has no
deduplication token; see :mod:`trainguard.infra.clickhouse.store`).

When ClickHouse refuses rows for what they hold (a value out of its column's range), retrying
cannot help and must not stall every topic: :class:`BatchWriter` bisects that table's part of the
batch until the refused events are isolated, inserts the rest and dead-letters each refused event
(``stage="sink:<table>"``, the server's message as the reason) on the dead-letter topic and in
``dead_letters``; an event whose row mapping raises is dead-lettered the same way without
bisection.  Undecodable records, and records of the signed topics that fail verification
(:mod:`trainguard.infra.signing`: unsigned, forged, expired, replayed), are dead-lettered by the consumer
(published to the dead-letter topic, stage ``decode`` or ``auth``) and stored here: a forged
decision is kept as evidence in ``dead_letters``, never as a decision.

No exception escapes :meth:`Sink.run`: an unexpected one is logged with its traceback, reported
to the observer as a failure and handled like an outage (the batch is read again after a pause,
never acknowledged).

An optional :class:`SinkObserver` hears of stored batches, failed inserts, dead letters and lag:
the worker feeds its Prometheus metrics and liveness check from it, without this module knowing
about either.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from trainguard.infra.backoff import Backoff
from trainguard.infra.bus import BusError, EventConsumer, EventProducer, dead_letter_for, verifier_for
from trainguard.infra.clickhouse.rows import TABLES, Row
from trainguard.infra.clickhouse.store import ClickHouseStore, StoreError, describe_error
from trainguard.infra.config import Settings
from trainguard.schemas.base import Event
from trainguard.schemas.codec import to_dict
from trainguard.schemas.control import DeadLetter
from trainguard.schemas.topics import DEAD_LETTERS, TOPICS, topic_for
from trainguard.schemas.typecheck import bounds

log = logging.getLogger(__name__)

#: the group of a sink without a configured one (a stream worker's is ``<app_id>-sink``).
DEFAULT_GROUP = "trainguard-sink"
#: with nothing buffered, commit the consumed positions this often: a new group that starts at the
#: end of its topics then has offsets to rewind to, instead of the beginning of every topic.
IDLE_COMMIT_S = 2.0
#: how often the observer is told the lag.
LAG_INTERVAL_S = 5.0


@dataclass(frozen=True)
class SinkConfig:
    """The sink's settings; in a worker, its ``sink`` section (``TRAINGUARD__WORKER__SINK__*``)."""

    #: consumer group; "" means ``trainguard-sink`` (a stream worker: ``<app_id>-sink``).
    group_id: str = ""
    #: flush when this many events are buffered ...
    batch_size: int = field(default=2_000, metadata=bounds(1, 1_000_000))
    #: ... or when the oldest buffered event has waited this long.
    max_wait_s: float = field(default=1.0, metadata=bounds(0.01, 600))
    #: after a failed insert, wait this long before reading the batch again, doubling up to the max.
    retry_backoff_s: float = field(default=0.5, metadata=bounds(0.01, 60))
    retry_backoff_max_s: float = field(default=10.0, metadata=bounds(0.1, 3600))


class SinkObserver(Protocol):
    """What a sink reports as it goes (called from the sink's thread)."""

    def on_stored(self, rows: Mapping[str, int], events: int, seconds: float) -> None:
        """A batch of ``events`` is in ClickHouse (``rows`` per table) after an insert of ``seconds``."""

    def on_failure(self, error: Exception) -> None:
        """An insert failed (or anything else did); the batch will be read again after a pause."""

    def on_dead_letters(self, n: int) -> None:
        """``n`` records were dead-lettered: undecodable, or refused by ClickHouse."""

    def on_lag(self, lag: Mapping[str, int], buffered: int) -> None:
        """Records not stored yet: behind the high watermark per topic (over this sink's
        partitions), and read but still in the buffer."""


@dataclass
class SinkStats:
    #: decoded events read, and undecodable records read (dead-lettered by the consumer).
    events: int = 0
    dead_letters: int = 0
    batches: int = 0
    #: failed attempts to store a batch (each is read again); ``errors`` of them were unexpected.
    failed_inserts: int = 0
    errors: int = 0
    #: events ClickHouse refused (or whose rows could not be made), dead-lettered by the sink.
    refused: int = 0
    #: refused dead letters that could not be stored either (logged; they stay on the topic).
    dropped: int = 0
    rows: dict[str, int] = field(default_factory=dict)


# -- storing one batch ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    """Stands in for the consumed record of an event that has none (a dead letter made by the
    consumer): what :func:`~trainguard.infra.bus.dead_letter_for` reads."""

    topic: str
    key: bytes | None
    value: bytes
    partition: int = -1
    offset: int = -1


@dataclass
class _Item:
    record: Any
    event: Event
    rows: list[Row]


@dataclass
class Written:
    """What :meth:`BatchWriter.write` did: rows per table (the sink's dead letters included), the
    dead letters it made for refused events, and how many of those it could not store."""

    rows: dict[str, int]
    dead_letters: list[DeadLetter]
    dropped: int = 0


def _payload(event: Event) -> bytes:
    """The event as wire JSON for a dead letter; never fails (a lone surrogate is escaped)."""
    try:
        text = json.dumps(to_dict(event), separators=(",", ":"), ensure_ascii=False, default=str)
    except Exception:
        text = repr(event)
    return text.encode("utf-8", "backslashreplace")


def _source_of(event: Event) -> _Source:
    try:
        topic = topic_for(event)
        return _Source(topic.name, topic.key_of(event), _payload(event))
    except Exception:
        return _Source(DEAD_LETTERS.name, None, _payload(event))


def _where(record: Any, event: Event) -> str:
    if record is None:
        return f"a {type(event).__name__}"
    return f"{type(event).__name__} {record.topic}[{record.partition}]@{record.offset}"


class BatchWriter:
    """Stores a batch of (record, event): one insert per table, refused events dead-lettered.

    :meth:`write` raises only when the batch must be tried again (a retryable
    :class:`StoreError`, Kafka not acknowledging the dead letters, anything unexpected); when it
    returns, every event is in ClickHouse or dead-lettered -- published with ``publish`` and stored
    in ``dead_letters`` -- and the batch can be acknowledged.
    """

    def __init__(self, store: ClickHouseStore, publish: Callable[[list[DeadLetter]], None]) -> None:
        self.store = store
        self.publish = publish

    def write(self, items: Sequence[tuple[Any, Event]]) -> Written:
        written: dict[str, int] = {}
        dead: list[DeadLetter] = []
        dropped = 0

        def refuse(record: Any, event: Event, stage: str, reason: str) -> None:
            nonlocal dropped
            if isinstance(event, DeadLetter) and event.stage.startswith("sink"):
                # One of ours, refused again: a dead letter of it would be refused the same way,
                # round and round the dead-letter topic.  It stays on that topic.
                log.error("sink: cannot store %s (%.300s): %s", _where(record, event), event.reason, reason)
                dropped += 1
                return
            log.error("sink: dead-lettering %s at %s: %s", _where(record, event), stage, reason)
            reason = reason.encode("utf-8", "backslashreplace").decode("utf-8")  # storable whatever it quotes
            dead.append(dead_letter_for(record if record is not None else _source_of(event), reason, stage))

        tables: dict[str, list[_Item]] = {}
        for record, event in items:
            entry = TABLES.get(type(event))
            if entry is None:
                refuse(record, event, "sink", f"no table stores {type(event).__name__}")
                continue
            table, flatten = entry
            try:
                rows = flatten(event)
            except Exception as exc:  # a mapper that cannot take this event: its fault, not the batch's
                log.debug("row mapping of %s failed", _where(record, event), exc_info=True)
                refuse(record, event, f"sink:{table}", f"row mapping failed: {describe_error(exc)}")
                continue
            tables.setdefault(table, []).append(_Item(record, event, rows))

        for table, group in tables.items():
            n, refused = self._insert(table, group)
            written[table] = written.get(table, 0) + n
            for item, reason in refused:
                refuse(item.record, item.event, f"sink:{table}", reason)

        if dead:
            self.publish(dead)  # raises if Kafka does not take them: the batch is tried again
            table, flatten = TABLES[DeadLetter]
            n, refused = self._insert(table, [_Item(None, d, flatten(d)) for d in dead])
            written[table] = written.get(table, 0) + n
            for item, reason in refused:  # on the dead-letter topic all the same
                d = cast(DeadLetter, item.event)
                log.error(
                    "sink: cannot store its dead letter for %s[%d]@%d: %s",
                    d.topic,
                    d.partition,
                    d.offset,
                    reason,
                )
                dropped += 1
        return Written(written, dead, dropped)

    def _insert(
        self, table: str, items: list[_Item], top: bool = True
    ) -> tuple[int, list[tuple[_Item, str]]]:
        """Insert ``items`` into ``table``; when ClickHouse refuses the rows themselves, halve
        the batch until every refused event is alone (about 2 log2(n) inserts per refused event).
        Returns rows stored and (item, reason) per refused event; a retryable failure raises."""
        rows = [row for item in items for row in item.rows]
        if not rows:
            return 0, []
        try:
            return self.store.insert_rows(table, rows), []
        except StoreError as exc:
            if exc.retryable:
                raise
            if len(items) == 1:
                return 0, [(items[0], str(exc))]
            log.log(
                logging.WARNING if top else logging.DEBUG,
                "sink: %s refused a batch of %d events, bisecting: %s",
                table,
                len(items),
                exc,
            )
        mid = len(items) // 2
        n1, refused1 = self._insert(table, items[:mid], top=False)
        n2, refused2 = self._insert(table, items[mid:], top=False)
        return n1 + n2, refused1 + refused2


class Sink:
    """Consume every registry topic (or ``topics``) and write the events into ClickHouse."""

    def __init__(
        self,
        settings: Settings,
        cfg: SinkConfig | None = None,
        topics: list[str] | None = None,
        observer: SinkObserver | None = None,
        auto_offset_reset: str = "earliest",
    ) -> None:
        self.cfg = cfg or SinkConfig()
        self.observer = observer
        self.store = ClickHouseStore(settings.clickhouse)
        self.producer = EventProducer(settings.kafka)
        try:
            self.consumer = EventConsumer(
                settings.kafka,
                topics or [t.name for t in TOPICS],
                self.cfg.group_id or DEFAULT_GROUP,
                producer=self.producer,
                # A record of a signed topic that fails verification is dead-lettered (stage
                # ``auth``, payload kept as evidence), never stored as a decision or a spec.
                verifier=verifier_for(settings),
                verify_at_record_time=True,  # stored late (an outage) is not acted on late
                auto_offset_reset=auto_offset_reset,
            )
        except Exception:
            self.producer.close()
            self.store.close()
            raise
        self.writer = BatchWriter(self.store, self._publish)
        self.stats = SinkStats()
        self._buffer: list[tuple[Any, Event]] = []
        self._oldest = 0.0
        self._last_commit = 0.0
        self._last_input = 0.0
        self._last_lag = 0.0
        #: a dropped batch's rewind has failed: no reading nor committing until it succeeds.
        self._rewind_pending = False

    def _publish(self, dead: list[DeadLetter]) -> None:
        """Put the sink's dead letters on the dead-letter topic, acknowledged (or raise)."""
        futures = [self.producer.send(d, DEAD_LETTERS) for d in dead]
        self.producer.flush()
        for f in futures:
            f.get(timeout=30)  # kafka-python's flush does not raise for a failed send; get() does

    def _notify(self, call: Callable[[SinkObserver], None]) -> None:
        if self.observer is None:
            return
        try:
            call(self.observer)
        except Exception:  # an observer's bug must not make the sink retry or stop
            log.exception("sink observer failed")

    def _commit(self) -> None:
        from kafka.errors import KafkaError

        try:
            self.consumer.commit()
        except KafkaError as exc:  # e.g. a rebalance: the next member rereads, the store dedups
            log.warning("sink offset commit failed: %s", exc)
        self._last_commit = time.monotonic()

    def _failed(self, exc: Exception) -> None:
        """Count and report a failed attempt at a batch (the caller drops and rereads it)."""
        from kafka.errors import KafkaError

        self.stats.failed_inserts += 1
        if isinstance(exc, StoreError):
            log.warning("sink insert failed, will retry the batch: %s", exc)
            try:  # reconnect, reread the columns: a migration may be what it waited for
                self.store.reset()
            except Exception as again:
                log.warning("sink: closing the ClickHouse connection failed: %s", again)
        elif isinstance(exc, BusError | KafkaError):
            log.warning("sink: Kafka failed, will retry the batch: %s", exc)
        else:
            self.stats.errors += 1
            log.error("sink: unexpected error, will retry the batch", exc_info=exc)
        self._notify(lambda o: o.on_failure(exc))

    def _drop_buffer(self) -> None:
        """Forget the buffered records and go back to the committed offsets to read them again."""
        self._buffer.clear()
        self._rewind_pending = True
        self._rewind()

    def _rewind(self) -> None:
        try:
            self.consumer.rewind()
            self._rewind_pending = False
        except Exception as exc:  # tried again before the next read
            log.warning("sink rewind failed: %s", exc)

    def _flush(self) -> bool:
        t0 = time.perf_counter()
        try:
            out = self.writer.write(self._buffer)
            seconds = time.perf_counter() - t0
            self._commit()
        except Exception as exc:
            self._failed(exc)
            return False
        for table, n in out.rows.items():
            self.stats.rows[table] = self.stats.rows.get(table, 0) + n
        self.stats.batches += 1
        self.stats.refused += len(out.dead_letters)
        self.stats.dropped += out.dropped
        events = len(self._buffer)
        self._buffer.clear()
        self._notify(lambda o: o.on_stored(out.rows, events, seconds))
        if out.dead_letters:
            self._notify(lambda o: o.on_dead_letters(len(out.dead_letters)))
        return True

    def _step(self, backoff: Backoff, should_stop: Callable[[], bool], idle_exit_s: float | None) -> bool:
        """One poll and maybe one flush; true when the sink has been idle for ``idle_exit_s``."""
        if self._rewind_pending:
            self.consumer.rewind()  # raises while Kafka is away: the loop backs off
            self._rewind_pending = False
        batch = self.consumer.poll(timeout_ms=200)
        got: list[tuple[Any, Event]] = [(None, d) for d in batch.dead_letters]
        got += batch.pairs()
        now = time.monotonic()
        if got:
            if not self._buffer:
                self._oldest = now
            self._buffer.extend(got)
            self.stats.events += len(batch.events)
            self.stats.dead_letters += len(batch.dead_letters)
            self._last_input = now
            if batch.dead_letters:
                self._notify(lambda o: o.on_dead_letters(len(batch.dead_letters)))
        if self.observer is not None and now - self._last_lag >= LAG_INTERVAL_S:
            self._last_lag = now
            try:
                lag = self.consumer.lag()
            except Exception as exc:
                log.warning("sink lag unknown: %s", exc)
            else:
                self._notify(lambda o: o.on_lag(lag, len(self._buffer)))
        due = len(self._buffer) >= self.cfg.batch_size or (
            self._buffer and now - self._oldest >= self.cfg.max_wait_s
        )
        if due:
            if not self._flush():
                # Drop the in-memory copy and re-read from the committed offsets after a pause:
                # memory stays bounded however long ClickHouse is down.
                self._drop_buffer()
                _sleep(backoff.next_delay(), should_stop)
                return False
            backoff.reset()
        elif not self._buffer and now - self._last_commit >= IDLE_COMMIT_S:
            self._commit()
        return idle_exit_s is not None and not self._buffer and now - self._last_input > idle_exit_s

    def run(self, should_stop: Callable[[], bool], idle_exit_s: float | None = None) -> SinkStats:
        """Loop until ``should_stop()``; with ``idle_exit_s``, also stop after that long with no input.

        Never raises (but for ``BaseException``s such as ``KeyboardInterrupt``): a failure of any
        kind drops the batch, which is read again after a pause."""
        backoff = Backoff(initial_s=self.cfg.retry_backoff_s, max_s=self.cfg.retry_backoff_max_s)
        self._last_input = time.monotonic()
        while not should_stop():
            try:
                if self._step(backoff, should_stop, idle_exit_s):
                    break
            except Exception as exc:  # Kafka away while polling or rewinding, or a bug
                self._failed(exc)
                self._drop_buffer()
                _sleep(backoff.next_delay(), should_stop)
        if self._buffer and not self._rewind_pending:
            self._flush()  # one last try; if it fails, the uncommitted records are read again later
        return self.stats

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()
        self.store.close()


class SinkThread(threading.Thread):
    """A :class:`Sink` in a daemon thread until :meth:`stop`, rebuilt when it cannot be built.

    Failures while running are the sink's own business (it retries, :meth:`Sink.run` never
    raises); a sink that cannot be built (Kafka unreachable when the consumer is made) is tried
    again after a pause (the same backoff policy), as is one whose loop failed all the same.
    """

    def __init__(
        self,
        settings: Settings,
        cfg: SinkConfig,
        observer: SinkObserver | None = None,
        auto_offset_reset: str = "earliest",
        topics: list[str] | None = None,
    ) -> None:
        super().__init__(name="trainguard-sink", daemon=True)
        self.settings, self.cfg, self.observer = settings, cfg, observer
        self.auto_offset_reset, self.topics = auto_offset_reset, topics
        self.restarts = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        backoff = Backoff(initial_s=self.cfg.retry_backoff_s, max_s=self.cfg.retry_backoff_max_s)
        while not self._stop_event.is_set():
            sink: Sink | None = None
            try:
                sink = Sink(self.settings, self.cfg, self.topics, self.observer, self.auto_offset_reset)
                backoff.reset()
                sink.run(self._stop_event.is_set)
            except Exception:
                self.restarts += 1
                delay = backoff.next_delay()
                log.exception("sink loop failed; starting a new one in %.1fs", delay)
                self._stop_event.wait(delay)
            finally:
                if sink is not None:
                    try:
                        sink.close()
                    except Exception as exc:
                        log.warning("closing the sink failed: %s", exc)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the loop to stop (it flushes what it holds once) and wait for it."""
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout_s)


def _sleep(seconds: float, should_stop: Callable[[], bool]) -> None:
    """Sleep ``seconds`` unless ``should_stop()`` says otherwise first (checked every 0.2 s)."""
    deadline = time.monotonic() + seconds
    while not should_stop():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.2))
