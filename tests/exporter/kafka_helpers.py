"""Reading events back from the real broker in exporter integration tests (no mocks)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from trainguard.infra.bus import decode_record
from trainguard.infra.config import KafkaConfig
from trainguard.schemas.base import Event
from trainguard.schemas.control import DeadLetter


class TopicReader:
    """Assigns every partition of ``topics`` from their current end (or the beginning)."""

    def __init__(self, cfg: KafkaConfig, topics: list[str], from_beginning: bool = False) -> None:
        from kafka import KafkaConsumer, TopicPartition

        self.consumer: Any = KafkaConsumer(**cfg.client_kwargs(), enable_auto_commit=False)
        parts = [
            TopicPartition(t, p) for t in topics for p in sorted(self.consumer.partitions_for_topic(t) or [])
        ]
        self.consumer.assign(parts)
        if from_beginning:
            self.consumer.seek_to_beginning(*parts)
        else:
            self.consumer.seek_to_end(*parts)
            for tp in parts:
                self.consumer.position(tp)  # resolve "end" now, before the test produces anything

    def read_until(
        self, keep: Callable[[Event], bool], done: Callable[[list[Event]], bool], timeout_s: float = 60.0
    ) -> list[Event]:
        got: list[Event] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not done(got):
            for records in self.consumer.poll(timeout_ms=300).values():
                for rec in records:
                    ev = decode_record(rec)
                    assert not isinstance(ev, DeadLetter), ev.reason
                    if keep(ev):
                        got.append(ev)
        return got

    def close(self) -> None:
        self.consumer.close()
