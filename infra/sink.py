"""Kafka -> ClickHouse sink: the one loop that stores the registry topics (kafka-python consumer group).

The stream worker runs it in a thread of its own with a consumer group of its own
(``<app_id>-sink``), so a ClickHouse outage never holds up the detection agents; ``trainguard
smoke`` and the tests run the very same :class:`Sink`.

At-least-once: offsets are committed only after the batch is in ClickHouse.  When an insert fails
the loop drops its in-memory copy, rewinds to the committed offsets and waits (the shared
:class:`~infra.backoff.Backoff` policy) before reading the batch again: memory stays bounded
however long ClickHouse is down, nothing is lost and the process stays up.  Duplicates from
redelivery collapse in the ReplacingMergeTree tables.  Undecodable records become dead letters:
the consumer publishes them to the dead-letter topic and the sink stores them (``dead_letters``).

An optional :class:`SinkObserver` hears of stored batches, failed inserts, dead letters and lag:
the worker feeds its Prometheus metrics and liveness check from it, without this module knowing
about either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from infra.backoff import Backoff
from infra.bus import EventConsumer, EventProducer
from infra.clickhouse.store import ClickHouseStore, StoreError
from infra.config import Settings
from schemas.base import Event
from schemas.topics import TOPICS
from schemas.typecheck import bounds

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
        """An insert failed; the batch will be read again after a pause."""

    def on_dead_letters(self, n: int) -> None:
        """``n`` undecodable records were dead-lettered."""

    def on_lag(self, lag: Mapping[str, int], buffered: int) -> None:
        """Records not stored yet: behind the high watermark per topic (over this sink's
        partitions), and read but still in the buffer."""


@dataclass
class SinkStats:
    events: int = 0
    dead_letters: int = 0
    batches: int = 0
    failed_inserts: int = 0
    rows: dict[str, int] = field(default_factory=dict)


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
                auto_offset_reset=auto_offset_reset,
            )
        except Exception:
            self.producer.close()
            self.store.close()
            raise
        self.stats = SinkStats()
        self._buffer: list[Event] = []
        self._oldest = 0.0
        self._last_commit = 0.0

    def _commit(self) -> None:
        from kafka.errors import KafkaError

        try:
            self.consumer.commit()
        except KafkaError as exc:  # e.g. a rebalance: the next member rereads, the store dedups
            log.warning("sink offset commit failed: %s", exc)
        self._last_commit = time.monotonic()

    def _flush(self) -> bool:
        t0 = time.perf_counter()
        try:
            written = self.store.insert_events(self._buffer)
        except StoreError as exc:
            self.stats.failed_inserts += 1
            log.warning("sink insert failed, will retry the batch: %s", exc)
            if self.observer is not None:
                self.observer.on_failure(exc)
            return False
        seconds = time.perf_counter() - t0
        for table, n in written.items():
            self.stats.rows[table] = self.stats.rows.get(table, 0) + n
        self._commit()
        self.stats.batches += 1
        if self.observer is not None:
            self.observer.on_stored(written, len(self._buffer), seconds)
        self._buffer.clear()
        return True

    def run(self, should_stop: Callable[[], bool], idle_exit_s: float | None = None) -> SinkStats:
        """Loop until ``should_stop()``; with ``idle_exit_s``, also stop after that long with no input."""
        backoff = Backoff(initial_s=self.cfg.retry_backoff_s, max_s=self.cfg.retry_backoff_max_s)
        last_input = time.monotonic()
        last_lag = 0.0
        while not should_stop():
            batch = self.consumer.poll(timeout_ms=200)
            got = batch.events + list(batch.dead_letters)
            now = time.monotonic()
            if got:
                if not self._buffer:
                    self._oldest = now
                self._buffer.extend(got)
                self.stats.events += len(batch.events)
                self.stats.dead_letters += len(batch.dead_letters)
                last_input = now
                if batch.dead_letters and self.observer is not None:
                    self.observer.on_dead_letters(len(batch.dead_letters))
            if self.observer is not None and now - last_lag >= LAG_INTERVAL_S:
                self.observer.on_lag(self.consumer.lag(), len(self._buffer))
                last_lag = now
            due = len(self._buffer) >= self.cfg.batch_size or (
                self._buffer and now - self._oldest >= self.cfg.max_wait_s
            )
            if due:
                if not self._flush():
                    # Drop the in-memory copy and re-read from the committed offsets after a pause:
                    # memory stays bounded however long ClickHouse is down.
                    self._buffer.clear()
                    self.consumer.rewind()
                    _sleep(backoff.next_delay(), should_stop)
                    continue
                backoff.reset()
            elif not self._buffer and now - self._last_commit >= IDLE_COMMIT_S:
                self._commit()
            if idle_exit_s is not None and not self._buffer and now - last_input > idle_exit_s:
                break
        if self._buffer:
            self._flush()  # one last try; if it fails, the uncommitted records are read again later
        return self.stats

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()
        self.store.close()


class SinkThread(threading.Thread):
    """A :class:`Sink` in a daemon thread until :meth:`stop`, rebuilt after an unexpected error.

    A failed insert is the sink's own business (it retries); anything else that escapes the loop
    (Kafka unreachable when the consumer is built, a broken connection) closes the sink and
    builds a new one after a pause (the same backoff policy).
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
