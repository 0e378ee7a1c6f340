"""Kafka plumbing on kafka-python: topic creation, an event producer, a decoding consumer.

Anything that cannot be decoded becomes a :class:`~schemas.control.DeadLetter` carrying the
original bytes, the topic/partition/offset and the precise reason -- it is published to the
dead-letter topic and handed back to the caller (so a sink can store it), never dropped and never
allowed to stop the consumer.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from infra.config import KafkaConfig
from schemas.base import Event, now_ms
from schemas.codec import DecodeError, decode, encode
from schemas.control import DeadLetter
from schemas.topics import BY_NAME, DEAD_LETTERS, TOPICS, Topic, topic_for

log = logging.getLogger(__name__)


class BusError(RuntimeError):
    """Kafka is unreachable or refused an operation (the message says which)."""


def create_topics(cfg: KafkaConfig, topics: Iterable[Topic] = TOPICS) -> list[str]:
    """Create the registry's topics that do not exist; verify partition counts of those that do."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import KafkaError, TopicAlreadyExistsError

    try:
        admin = KafkaAdminClient(**cfg.client_kwargs())
    except (KafkaError, OSError) as exc:
        raise BusError(f"cannot reach Kafka at {cfg.bootstrap_servers}: {exc}") from exc
    try:
        existing = set(admin.list_topics())
        wanted = [t for t in topics if t.name not in existing]
        created = []
        for t in wanted:
            try:
                admin.create_topics([NewTopic(t.name, t.partitions, 1, topic_configs=t.configs())])
                created.append(t.name)
            except TopicAlreadyExistsError:  # raced with another `stack up`
                pass
        described = admin.describe_topics([t.name for t in topics])
        for d in described:
            name = d.get("name") or d.get("topic")  # kafka-python 3.x says "name", 2.x "topic"
            want = BY_NAME[name].partitions
            have = len(d.get("partitions") or [])
            if have and have != want:
                raise BusError(
                    f"topic {name} has {have} partitions, the registry says {want}; "
                    "Faust workers need them equal (recreate the topic or change the registry)"
                )
        return created
    except KafkaError as exc:
        raise BusError(f"creating topics failed: {exc}") from exc
    finally:
        admin.close()


@dataclass
class EventProducer:
    """Publishes events to their registry topic with the registry key (kafka-python)."""

    cfg: KafkaConfig
    linger_ms: int = 20
    extra: dict[str, Any] = field(default_factory=dict)
    _producer: Any = None

    def __post_init__(self) -> None:
        from kafka import KafkaProducer
        from kafka.errors import KafkaError

        try:
            self._producer = KafkaProducer(
                **self.cfg.client_kwargs(),
                linger_ms=self.linger_ms,
                compression_type=self.cfg.compression,
                acks="all",
                max_request_size=16 * 1024 * 1024,
                **self.extra,
            )
        except (KafkaError, OSError) as exc:
            raise BusError(f"cannot reach Kafka at {self.cfg.bootstrap_servers}: {exc}") from exc

    def send(self, event: Event, topic: Topic | None = None) -> Any:
        """Queue ``event``; returns kafka-python's future (``.get()`` blocks until acked)."""
        t = topic or topic_for(event)
        return self._producer.send(t.name, key=t.key_of(event), value=encode(event))

    def send_raw(self, topic: str, value: bytes | None, key: bytes | None = None) -> Any:
        return self._producer.send(topic, key=key, value=value)

    def flush(self, timeout_s: float | None = 30.0) -> None:
        from kafka.errors import KafkaError

        try:
            self._producer.flush(timeout=timeout_s)
        except KafkaError as exc:
            raise BusError(f"flushing to Kafka failed: {exc}") from exc

    def close(self, timeout_s: float = 10.0) -> None:
        self._producer.close(timeout=timeout_s)


def dead_letter_for(record: Any, reason: str, stage: str = "decode") -> DeadLetter:
    """A dead-letter event for a consumed record (kafka-python/aiokafka ConsumerRecord)."""
    raw: bytes = record.value or b""
    try:
        payload, b64 = raw.decode("utf-8"), False
    except UnicodeDecodeError:
        payload, b64 = base64.b64encode(raw).decode(), True
    key = record.key.decode("utf-8", "replace") if record.key else ""
    return DeadLetter(
        ts_ms=now_ms(),
        topic=record.topic,
        reason=reason[:60_000],
        stage=stage,
        partition=record.partition,
        offset=record.offset,
        key=key[:4000],
        payload=payload[:1_000_000],
        payload_b64=b64,
    )


def decode_record(record: Any) -> Event | DeadLetter:
    """Decode one consumed record against its topic's event type; a failure -> DeadLetter."""
    topic = BY_NAME.get(record.topic)
    try:
        return decode(record.value, expect=topic.event if topic else None)
    except DecodeError as exc:
        return dead_letter_for(record, str(exc))


@dataclass
class Batch:
    events: list[Event]
    dead_letters: list[DeadLetter]


class EventConsumer:
    """A consumer-group member that yields decoded batches and dead-letters garbage.

    Offsets are committed only by :meth:`commit`, after the caller has stored the batch, so a
    crash or a failed insert replays the batch (at-least-once; the store dedups).
    """

    def __init__(
        self,
        cfg: KafkaConfig,
        topics: list[str],
        group_id: str,
        producer: EventProducer | None = None,
        **kw: Any,
    ) -> None:
        from kafka import KafkaConsumer
        from kafka.errors import KafkaError

        self.cfg = cfg
        self.producer = producer
        options: dict[str, Any] = {
            "group_id": group_id,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "session_timeout_ms": 10_000,
            "heartbeat_interval_ms": 2_000,
            "max_poll_records": 2_000,
            "fetch_max_bytes": 32 * 1024 * 1024,
            "max_partition_fetch_bytes": 16 * 1024 * 1024,
        }
        options.update(kw)
        try:
            self._consumer = KafkaConsumer(*topics, **cfg.client_kwargs(), **options)
        except (KafkaError, OSError) as exc:
            raise BusError(f"cannot reach Kafka at {cfg.bootstrap_servers}: {exc}") from exc

    def poll(self, timeout_ms: int = 1000) -> Batch:
        records = self._consumer.poll(timeout_ms=timeout_ms)
        events: list[Event] = []
        dead: list[DeadLetter] = []
        for recs in records.values():
            for rec in recs:
                out = decode_record(rec)
                if isinstance(out, DeadLetter) and rec.topic != DEAD_LETTERS.name:
                    dead.append(out)
                else:
                    events.append(out)
        if dead and self.producer is not None:
            for d in dead:
                self.producer.send(d, DEAD_LETTERS)
            self.producer.flush()
        return Batch(events, dead)

    def commit(self) -> None:
        self._consumer.commit()

    def rewind(self) -> None:
        """Go back to the last committed offsets (after a failed store, to retry the batch)."""
        from kafka import TopicPartition

        for tp in self._consumer.assignment():
            committed = self._consumer.committed(TopicPartition(tp.topic, tp.partition))
            if committed is None:
                self._consumer.seek_to_beginning(tp)
            else:
                self._consumer.seek(tp, committed)

    def lag(self) -> dict[str, int]:
        """Records behind the high watermark per topic, over this member's partitions (last fetch)."""
        out: dict[str, int] = {}
        for tp in self._consumer.assignment():
            high, pos = self._consumer.highwater(tp), self._consumer.position(tp)
            if high is not None and pos is not None:
                out[tp.topic] = out.get(tp.topic, 0) + max(high - pos, 0)
        return out

    def close(self) -> None:
        self._consumer.close()
