"""Kafka -> ClickHouse sink loop (kafka-python consumer group, batched inserts).

At-least-once: offsets are committed only after the batch is in ClickHouse; when ClickHouse is
down the loop backs off, rewinds to the committed offsets and retries, so nothing is lost and the
process stays up.  Duplicates from redelivery collapse in the ReplacingMergeTree tables.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from infra.bus import EventConsumer, EventProducer
from infra.clickhouse.store import ClickHouseStore, StoreError
from infra.config import Settings
from schemas.base import Event
from schemas.topics import TOPICS
from schemas.typecheck import rng

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SinkConfig:
    group_id: str = "trainguard-sink"
    #: flush when this many events are buffered ...
    batch_size: int = field(default=5_000, metadata=rng(1, 1_000_000))
    #: ... or when the oldest buffered event has waited this long.
    max_wait_s: float = field(default=1.0, metadata=rng(0.01, 600))
    retry_backoff_s: float = field(default=1.0, metadata=rng(0.01, 60))
    retry_backoff_max_s: float = field(default=30.0, metadata=rng(0.1, 3600))


@dataclass
class SinkStats:
    events: int = 0
    dead_letters: int = 0
    batches: int = 0
    failed_inserts: int = 0
    rows: dict[str, int] = field(default_factory=dict)


class Sink:
    """Consume every registry topic and write the events into ClickHouse."""

    def __init__(
        self, settings: Settings, cfg: SinkConfig | None = None, topics: list[str] | None = None
    ) -> None:
        self.cfg = cfg or SinkConfig()
        self.store = ClickHouseStore(settings.clickhouse)
        self.producer = EventProducer(settings.kafka)
        self.consumer = EventConsumer(
            settings.kafka, topics or [t.name for t in TOPICS], self.cfg.group_id, producer=self.producer
        )
        self.stats = SinkStats()
        self._buffer: list[Event] = []
        self._oldest = 0.0

    def _flush(self) -> bool:
        if not self._buffer:
            self.consumer.commit()
            return True
        try:
            written = self.store.insert_events(self._buffer)
        except StoreError as exc:
            self.stats.failed_inserts += 1
            log.warning("sink insert failed, will retry the batch: %s", exc)
            return False
        for table, n in written.items():
            self.stats.rows[table] = self.stats.rows.get(table, 0) + n
        self.consumer.commit()
        self.stats.batches += 1
        self._buffer.clear()
        return True

    def run(self, should_stop: Callable[[], bool], idle_exit_s: float | None = None) -> SinkStats:
        """Loop until ``should_stop()``; with ``idle_exit_s``, also stop after that long with no input."""
        backoff = self.cfg.retry_backoff_s
        last_input = time.monotonic()
        while not should_stop():
            batch = self.consumer.poll(timeout_ms=200)
            got = batch.events + list(batch.dead_letters)
            if got:
                if not self._buffer:
                    self._oldest = time.monotonic()
                self._buffer.extend(got)
                self.stats.events += len(batch.events)
                self.stats.dead_letters += len(batch.dead_letters)
                last_input = time.monotonic()
            due = len(self._buffer) >= self.cfg.batch_size or (
                self._buffer and time.monotonic() - self._oldest >= self.cfg.max_wait_s
            )
            if due and not self._flush():
                # Drop the in-memory copy and re-read from the committed offsets after a pause:
                # memory stays bounded however long ClickHouse is down.
                self._buffer.clear()
                self.consumer.rewind()
                time.sleep(backoff)
                backoff = min(backoff * 2, self.cfg.retry_backoff_max_s)
                continue
            backoff = self.cfg.retry_backoff_s
            if idle_exit_s is not None and not self._buffer and time.monotonic() - last_input > idle_exit_s:
                break
        while self._buffer and not self._flush():
            time.sleep(self.cfg.retry_backoff_s)
            if should_stop():
                break
        return self.stats

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()
        self.store.close()
