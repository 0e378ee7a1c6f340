"""Kafka plumbing on kafka-python: topic creation, an event producer, a decoding consumer.

Anything that cannot be decoded becomes a :class:`~trainguard.schemas.control.DeadLetter` carrying the
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

from trainguard.infra.config import KafkaConfig, Settings
from trainguard.infra.signing import SIGNED_TOPICS, AuthError, Signer, Verifier
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.codec import DecodeError, decode, encode
from trainguard.schemas.control import DeadLetter
from trainguard.schemas.topics import BY_NAME, DEAD_LETTERS, TOPICS, Topic, namespaced, topic_for

log = logging.getLogger(__name__)


class BusError(RuntimeError):
    """Kafka is unreachable or refused an operation (the message says which)."""


def create_topics(cfg: KafkaConfig, topics: Iterable[Topic] = TOPICS, namespace: str = "") -> list[str]:
    """Create the registry's topics that do not exist; verify partition counts of those that do.

    ``namespace``: their twins in that topic namespace instead (:func:`trainguard.schemas.topics.namespaced`,
    e.g. ``shadow``), with the same partitions and configs; ``""`` is the live topics.  Partitions,
    replication factor and ``min.insync.replicas`` are the deployment's (:meth:`KafkaConfig.topic_plan`).
    """
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import InvalidReplicationFactorError, KafkaError, TopicAlreadyExistsError

    try:
        admin = KafkaAdminClient(**cfg.client_kwargs())
    except (KafkaError, OSError) as exc:
        raise BusError(f"cannot reach Kafka at {cfg.bootstrap_servers}: {exc}") from exc
    by_name = {namespaced(t.name, namespace): t for t in topics}
    try:
        existing = set(admin.list_topics())
        wanted = [(n, t) for n, t in by_name.items() if n not in existing]
        created = []
        for name, t in wanted:
            plan = cfg.topic_plan(t)
            configs = {**t.configs(), "min.insync.replicas": str(plan.min_insync_replicas)}
            try:
                admin.create_topics(
                    [NewTopic(name, plan.partitions, plan.replication_factor, topic_configs=configs)]
                )
                created.append(name)
            except TopicAlreadyExistsError:  # raced with another `stack up`
                pass
            except InvalidReplicationFactorError as exc:
                brokers = len(admin.describe_cluster().get("brokers") or [])
                raise BusError(
                    f"topic {name}: replication factor {plan.replication_factor} needs as many live "
                    f"brokers, the cluster at {cfg.bootstrap_servers} has {brokers} "
                    "(lower kafka.replication_factor, or start the missing brokers)"
                ) from exc
        described = admin.describe_topics(list(by_name))
        for d in described:
            name = d.get("name") or d.get("topic")  # kafka-python 3.x says "name", 2.x "topic"
            want = cfg.partitions(by_name[name])
            have = len(d.get("partitions") or [])
            if have and have != want:
                raise BusError(
                    f"topic {name} has {have} partitions, the configuration says {want}; "
                    "Faust workers need them equal (recreate the topic or change kafka.topics)"
                )
        return created
    except KafkaError as exc:
        raise BusError(f"creating topics failed: {exc}") from exc
    finally:
        admin.close()


def signer_for(settings: Settings, principal: str) -> Signer | None:
    """The signer of a process acting as ``principal`` (None when signing is off)."""
    cfg = settings.signing
    if not cfg.enabled:
        return None
    return Signer.load(cfg, settings.stack.home_path, cfg.principal or principal)


def verifier_for(settings: Settings) -> Verifier | None:
    """The verifier of the control-plane topics (None when signing is off)."""
    cfg = settings.signing
    return Verifier.load(cfg, settings.stack.home_path) if cfg.enabled else None


def authentic(verifier: Verifier | None, record: Any, at_record_time: bool = False) -> str:
    """ "" when ``record`` may be acted on, else why not (its signature failed verification).

    Records of unsigned topics (telemetry) and every record when signing is off pass.
    ``at_record_time``: judge expiry at the record's own timestamp, not now (what storage needs:
    a decision read after a long ClickHouse outage was valid when written; acting needs now)."""
    if verifier is None or record.topic not in SIGNED_TOPICS:
        return ""
    at = now_ms()
    if at_record_time and isinstance(getattr(record, "timestamp", None), int) and record.timestamp > 0:
        at = record.timestamp
    try:
        verifier.verify(
            record.topic,
            record.key,
            record.value,
            record.headers,
            at,
            (record.topic, record.partition, record.offset),
        )
    except AuthError as exc:
        return str(exc)
    return ""


@dataclass
class EventProducer:
    """Publishes events to their registry topic with the registry key (kafka-python); control-plane
    records (:data:`~trainguard.infra.signing.SIGNED_TOPICS`) are signed when a ``signer`` is given."""

    cfg: KafkaConfig
    linger_ms: int = 20
    extra: dict[str, Any] = field(default_factory=dict)
    signer: Signer | None = None
    _producer: Any = None

    def __post_init__(self) -> None:
        from kafka import KafkaProducer
        from kafka.errors import KafkaError

        try:
            self._producer = KafkaProducer(
                **self.cfg.client_kwargs(),
                linger_ms=self.linger_ms,
                compression_type=self.cfg.compression,
                # Every in-sync replica has the record before it counts as sent, and a retry after a
                # leader change is not written twice (kafka-python's default with acks=all; said so).
                acks="all",
                enable_idempotence=True,
                max_request_size=16 * 1024 * 1024,
                **self.extra,
            )
        except (KafkaError, OSError) as exc:
            raise BusError(f"cannot reach Kafka at {self.cfg.bootstrap_servers}: {exc}") from exc

    def send(self, event: Event, topic: Topic | None = None) -> Any:
        """Queue ``event``; returns kafka-python's future (``.get()`` blocks until acked)."""
        t = topic or topic_for(event)
        key, value = t.key_of(event), encode(event)
        headers = None
        if self.signer is not None and t.name in SIGNED_TOPICS:
            headers = self.signer.headers(t.name, key, value)
        return self._producer.send(t.name, key=key, value=value, headers=headers)

    def send_raw(self, topic: str, value: bytes | None, key: bytes | None = None, sign: bool = False) -> Any:
        """Queue bytes as they are.  ``sign``: sign them like :meth:`send` would on a signed topic
        (a test that puts garbage past verification, to reach the decoder)."""
        headers = None
        if sign and self.signer is not None and topic in SIGNED_TOPICS:
            headers = self.signer.headers(topic, key, value)
        return self._producer.send(topic, key=key, value=value, headers=headers)

    def flush(self, timeout_s: float | None = 30.0) -> None:
        from kafka.errors import KafkaError

        try:
            self._producer.flush(timeout=timeout_s)
        except KafkaError as exc:
            raise BusError(f"flushing to Kafka failed: {exc}") from exc

    def close(self, timeout_s: float = 10.0) -> None:
        self._producer.close(timeout=timeout_s)


class RejectedRecord(ValueError):
    """A handler's verdict that a record is bad (a command it cannot apply): dead-lettered like
    any failure, but logged without a traceback (there is no bug to look at)."""


def trace_of(exc: BaseException) -> BaseException | None:
    """What to pass as ``exc_info`` when logging a failed record: the traceback, unless the
    record was rejected on purpose (:class:`RejectedRecord`, the decoder's :class:`DecodeError`, a
    signature check's :class:`AuthError`)."""
    return None if isinstance(exc, RejectedRecord | DecodeError | AuthError) else exc


def coordinates(record: Any) -> str:
    """``topic[partition]@offset`` of a consumed record, for log lines."""
    return f"{record.topic}[{record.partition}]@{record.offset}"


def error_text(exc: BaseException) -> str:
    """What a dead letter says about the exception that made its record fail."""
    return f"{type(exc).__name__}: {exc}"


def _printable(text: str) -> str:
    # A reason quoting the record (a lone surrogate, say) must not make the dead letter unencodable.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def dead_letter_for(record: Any, reason: str, stage: str = "decode") -> DeadLetter:
    """A dead-letter event for a consumed record (kafka-python/aiokafka ConsumerRecord)."""
    raw = record.value or b""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "backslashreplace")
    try:
        payload, b64 = raw.decode("utf-8"), False
    except UnicodeDecodeError:
        payload, b64 = base64.b64encode(raw).decode(), True
    key = record.key.decode("utf-8", "replace") if isinstance(record.key, bytes) else str(record.key or "")
    return DeadLetter(
        ts_ms=now_ms(),
        topic=record.topic,
        reason=_printable(reason)[:60_000],
        stage=_printable(stage)[:256],
        partition=record.partition,
        offset=record.offset,
        key=key[:4000],
        payload=payload[:1_000_000],
        payload_b64=b64,
    )


def poisoned(record: Any, stage: str, exc: BaseException, logger: logging.Logger = log) -> DeadLetter:
    """The dead letter for a record that failed at ``stage`` (``"actions:accept"``,
    ``"worker:control"``, ...), logged once at ERROR with its coordinates.

    For a record that is *bad* (it decodes but its handling raises): the caller publishes the
    dead letter and moves past the record.  Not for the world being down (a broker or a disk
    away), which the caller retries with :class:`trainguard.infra.backoff.Backoff` instead.
    """
    reason = error_text(exc)
    logger.error("%s: dead-lettering %s: %s", stage, coordinates(record), reason, exc_info=trace_of(exc))
    return dead_letter_for(record, reason, stage)


def decode_record(record: Any) -> Event | DeadLetter:
    """Decode one consumed record against its topic's event type; a failure -> DeadLetter.

    Any exception of the decoder is the record's fault (not only :class:`DecodeError`: a
    4,301-digit integer makes ``json`` raise ``ValueError``), so none escapes."""
    topic = BY_NAME.get(record.topic)
    try:
        return decode(record.value, expect=topic.event if topic else None)
    except DecodeError as exc:
        return dead_letter_for(record, str(exc))
    except Exception as exc:
        return dead_letter_for(record, f"undecodable: {error_text(exc)}")


def seek_back(consumer: Any, records: Iterable[Any]) -> None:
    """Point a kafka-python consumer back at ``records`` (unhandled ones, to read again after the
    world came back): each partition to the lowest offset among them.  Local to the consumer, no
    broker round trip."""
    from kafka import TopicPartition

    first: dict[tuple[str, int], int] = {}
    for r in records:
        tp = (r.topic, r.partition)
        first[tp] = min(first.get(tp, r.offset), r.offset)
    for (topic, partition), offset in first.items():
        consumer.seek(TopicPartition(topic, partition), offset)


@dataclass
class Batch:
    events: list[Event]
    dead_letters: list[DeadLetter]
    #: the consumed record each event came from (same order as ``events``): its coordinates, for
    #: dead-lettering an event whose handling fails.
    records: list[Any] = field(default_factory=list)

    def pairs(self) -> list[tuple[Any, Event]]:
        """(record, event) for every decoded event (record None where the batch has no records)."""
        recs = self.records if len(self.records) == len(self.events) else [None] * len(self.events)
        return list(zip(recs, self.events, strict=True))


def offsets_at(consumer: Any, parts: list[Any], since_ms: int) -> dict[Any, int]:
    """For each partition of ``parts``, the offset of its first record at or after ``since_ms``
    (its end when there is none): two broker round trips for all of them."""
    found = consumer.offsets_for_times(dict.fromkeys(parts, since_ms))
    ends = consumer.end_offsets(parts)
    return {tp: at.offset if (at := found.get(tp)) is not None else ends[tp] for tp in parts}


def seed_group_offsets(cfg: KafkaConfig, group_id: str, topics: list[str], start_ms: int) -> dict[str, int]:
    """Commit, for every partition of ``topics`` the group has no offset for, the offset of the
    first record at or after ``start_ms`` (the end when there is none); partitions with a
    committed offset are left alone.  Returns ``"topic[partition]" -> offset`` of those seeded.

    Done before the group's first member joins, as a standalone committer (a commit Kafka accepts
    only while the group has no live member: with one, the group is running and has its offsets,
    and a refused commit is logged and ignored -- the member starts from ``auto_offset_reset``)."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.errors import KafkaError
    from kafka.structs import OffsetAndMetadata

    seeder = KafkaConsumer(**cfg.client_kwargs(), group_id=group_id, enable_auto_commit=False)
    seeded: dict[str, int] = {}
    try:
        parts = [TopicPartition(t, p) for t in topics for p in sorted(seeder.partitions_for_topic(t) or ())]
        fresh = [tp for tp in parts if seeder.committed(tp) is None]
        if not fresh:
            return seeded
        seeder.assign(fresh)
        offsets = {tp: OffsetAndMetadata(o, "", -1) for tp, o in offsets_at(seeder, fresh, start_ms).items()}
        seeder.commit(offsets)
        seeded = {f"{tp.topic}[{tp.partition}]": o.offset for tp, o in offsets.items()}
        log.info("group %s starts at %s (records before %d skipped)", group_id, seeded, start_ms)
    except KafkaError as exc:
        log.warning("group %s: could not seed its start offsets (%s): reading from the start", group_id, exc)
    finally:
        seeder.close()
    return seeded


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
        verifier: Verifier | None = None,
        verify_at_record_time: bool = False,
        start_ms: int | None = None,
        **kw: Any,
    ) -> None:
        """``start_ms``: where a group with no committed offset starts reading (the first record
        at or after that time) instead of the topic's beginning -- a new action service must not
        read a month of decisions it would refuse as too old, one by one, before the first new one."""
        from kafka import KafkaConsumer
        from kafka.errors import KafkaError

        self.cfg = cfg
        self.producer = producer
        #: records of signed topics that fail verification become dead letters (stage ``auth``).
        self.verifier = verifier
        self.verify_at_record_time = verify_at_record_time
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
            if start_ms is not None:
                seed_group_offsets(cfg, group_id, topics, start_ms)
            self._consumer = KafkaConsumer(**cfg.client_kwargs(), **options)
            # Metadata of every topic before the first join: a member that joins without it gets
            # no partitions of those topics (the range assignor skips them, "No partition metadata
            # for topic") and waits for a later metadata refresh to rejoin.
            if topics:
                self._consumer.partitions_for_topic(topics[0])
            self._consumer.subscribe(topics)
        except (KafkaError, OSError) as exc:
            raise BusError(f"cannot reach Kafka at {cfg.bootstrap_servers}: {exc}") from exc

    def poll(self, timeout_ms: int = 1000) -> Batch:
        records = self._consumer.poll(timeout_ms=timeout_ms)
        events: list[Event] = []
        dead: list[DeadLetter] = []
        sources: list[Any] = []
        for recs in records.values():
            for rec in recs:
                why = authentic(self.verifier, rec, self.verify_at_record_time)
                if why:
                    log.warning("auth: dead-lettering %s: %s", coordinates(rec), why)
                    dead.append(dead_letter_for(rec, why, "auth"))
                    continue
                out = decode_record(rec)
                if isinstance(out, DeadLetter) and rec.topic != DEAD_LETTERS.name:
                    dead.append(out)
                else:
                    events.append(out)
                    sources.append(rec)
        if dead and self.producer is not None:
            try:
                for d in dead:
                    self.producer.send(d, DEAD_LETTERS)
                self.producer.flush()
            except Exception:  # the broker away: the whole batch is read again, nothing lost
                self.seek_back([rec for recs in records.values() for rec in recs])
                raise
        return Batch(events, dead, sources)

    def commit(self) -> None:
        self._consumer.commit()

    def seek_back(self, records: Iterable[Any]) -> None:
        """Read ``records`` (and what follows them) again: see :func:`seek_back`."""
        seek_back(self._consumer, records)

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
