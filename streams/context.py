"""What every agent of a worker shares: settings, Faust topics, metrics, decode/emit helpers.

Agents stay thin by calling these: :meth:`WorkerContext.decode` turns a Faust event into a
schema event or dead-letters it (with topic, partition, offset, key and the reason),
:meth:`WorkerContext.emit` publishes an event to its registry topic with the registry key,
:meth:`WorkerContext.guard` wraps one event's processing so an exception dead-letters that event
instead of killing the agent, and :meth:`WorkerContext.follow` reads a whole topic on every
worker (what every worker must know, such as job specs).

No record stops an agent or a reader: each is handled in its own ``try``, and one that fails
(to decode, or later in its handling) is dead-lettered -- stage ``worker:<agent>`` --, logged
once at ERROR with its coordinates, counted in ``trainguard_dead_letters_total{agent}``, and
the consumer moves past it.  Only the broker being away is retried (:class:`Backoff`).

Every topic a worker reads or writes is named through :meth:`WorkerContext.topic_name`: with
``topic_namespace`` set (a shadow worker) each registry topic is replaced by its twin in that
namespace, and records read there are decoded as their registry topic's events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from trainguard.detectors.routing import INPUTS
from trainguard.infra.backoff import Backoff
from trainguard.infra.bus import (
    authentic,
    coordinates,
    dead_letter_for,
    error_text,
    signer_for,
    trace_of,
    verifier_for,
)
from trainguard.infra.config import KafkaConfig, Settings
from trainguard.infra.signing import SIGNED_TOPICS
from trainguard.schemas.base import Event
from trainguard.schemas.codec import DecodeError, decode, encode
from trainguard.schemas.topics import DEAD_LETTERS, TOPICS, Topic, namespaced, topic_for
from trainguard.streams.config import WorkerConfig
from trainguard.streams.kafka_compat import aiokafka_kwargs
from trainguard.streams.metrics import WorkerMetrics
from trainguard.streams.offsets import OffsetGuard

log = logging.getLogger(__name__)

#: the longest a gap's records are read for (then what is not read is logged and counted).
FILL_TIMEOUT_S = 30.0
#: the most records of one gap read directly (a larger gap's oldest are logged and counted).
MAX_FILL_RECORDS = 100_000


class ReadRecord:
    """A record read directly (:meth:`WorkerContext.fill_gap`), shaped like the Faust event the
    agents get: ``message`` (topic, partition, offset, headers), ``key``, ``value``."""

    def __init__(self, record: Any) -> None:
        self.message, self.key, self.value = record, record.key, record.value


def check_copartitioned(kafka: KafkaConfig) -> None:
    """Raise ``ValueError`` when the topics of one stage have different partition counts (set in
    ``kafka.topics``): a stage keeps a key's state on the worker that owns its partition, so a
    job's steps, exits and liveness -- or its decisions, dumps and Flight Recorder -- must land on
    the same partition number of each topic."""
    for stage, topics in INPUTS.items():
        counts = {t.name: kafka.partitions(t) for t in topics}
        if len(set(counts.values())) > 1:
            raise ValueError(
                f"kafka.topics: the {stage} stage's topics must have equal partitions, got {counts}"
            )


@dataclass
class WorkerContext:
    settings: Settings
    cfg: WorkerConfig
    app: Any
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    #: registry topic name -> Faust topic (raw bytes in and out: our codec does the decoding).
    topics: dict[str, Any] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    #: (topic, partition) -> last processed offset, for the lag gauge.
    positions: dict[tuple[str, int], int] = field(default_factory=dict)
    #: (topic, partition) -> high watermark when first measured (baseline before any progress).
    first_highwater: dict[tuple[str, int], int] = field(default_factory=dict)
    #: the next offset expected on each input partition: records Faust skipped are read again.
    offsets: OffsetGuard = field(default_factory=OffsetGuard)
    #: clear while the committed offsets of a new assignment's partitions are read (the agents
    #: wait: a record taken before its partition's start is known could be one out of order).
    offsets_ready: asyncio.Event = field(default_factory=asyncio.Event)
    #: agent -> when it began handling its current record (a fill of skipped records included).
    in_guard: dict[str, float] = field(default_factory=dict)
    #: the worker's topic namespace, fixed at start (a runtime config change does not move it).
    namespace: str = field(init=False)
    #: topic name in this worker's namespace -> registry topic.
    registry: dict[str, Topic] = field(init=False)

    def __post_init__(self) -> None:
        self.offsets_ready.set()  # cleared only while a new assignment's start offsets are read
        self.namespace = self.cfg.topic_namespace
        check_copartitioned(self.settings.kafka)
        self.registry = {self.topic_name(t): t for t in TOPICS}
        # Decisions and capture commands go out signed; decisions, job specs and control
        # commands come in verified (both None when signing is off).
        self.signer = signer_for(self.settings, "worker")
        self.verifier = verifier_for(self.settings)

    def topic_name(self, t: Topic) -> str:
        """What ``t`` is called in this worker's topic namespace (the registry name when live)."""
        return namespaced(t.name, self.namespace)

    def faust_topic(self, t: Topic) -> Any:
        if t.name not in self.topics:
            self.topics[t.name] = self.raw_topic(self.topic_name(t), self.settings.kafka.partitions(t))
        return self.topics[t.name]

    def raw_topic(self, name: str, partitions: int) -> Any:
        """A Faust topic of raw bytes (keys and values: our codec does the decoding)."""
        return self.app.topic(
            name,
            key_type=bytes,
            value_type=bytes,
            key_serializer="raw",
            value_serializer="raw",
            partitions=partitions,
            internal=False,
        )

    def faust_topics(self, *ts: Topic) -> Any:
        """One Faust topic object subscribed to several registry topics."""
        if len(ts) == 1:
            return self.faust_topic(ts[0])
        return self.app.topic(
            *(self.topic_name(t) for t in ts),
            key_type=bytes,
            value_type=bytes,
            key_serializer="raw",
            value_serializer="raw",
        )

    def track(self, message: Any) -> None:
        self.positions[(message.topic, message.partition)] = message.offset

    async def decode(self, event: Any, agent: str) -> Event | None:
        """The schema event carried by a Faust event, or None if it is garbage.

        Garbage is dead-lettered once: by the sink, which reads every topic; the agents only
        skip it (they dead-letter it themselves when the sink is disabled).
        """
        msg = event.message
        self.track(msg)
        topic = self.registry.get(msg.topic)
        why = authentic(self.verifier, msg)
        if why:  # never acted on; dead-lettered once, by the sink (which verifies too) if it runs
            log.warning("%s: not authentic, skipping %s: %s", agent, coordinates(msg), why)
            if not self.cfg.sink_enabled:
                await self.dead_letter(msg, why, agent, "auth")
            return None
        try:
            return decode(event.value, expect=topic.event if topic else None)
        except Exception as exc:  # DecodeError, or any other decoder failure: the record's fault
            if not self.cfg.sink_enabled:
                reason = str(exc) if isinstance(exc, DecodeError) else f"undecodable: {error_text(exc)}"
                await self.dead_letter(msg, reason, agent, "decode")
            return None

    async def dead_letter(self, msg: Any, reason: str, agent: str, stage: str) -> None:
        """Publish a dead letter for ``msg`` (a Faust message or a consumer record) and count it.

        Never raises: the record is skipped either way (its coordinates are in the log)."""
        if msg.topic == self.topic_name(DEAD_LETTERS):
            log.error("garbage on the dead-letter topic itself at offset %s: %s", msg.offset, reason)
            return
        self.metrics.dead_letters.labels(agent).inc()
        try:
            dl = dead_letter_for(msg, f"[{agent}] {reason}", stage)  # Faust messages read like records
            await self.emit(dl)
        except Exception as exc:
            log.error("%s: could not publish the dead letter for %s: %s", agent, coordinates(msg), exc)

    async def reject(self, msg: Any, agent: str, exc: BaseException, stage: str = "") -> None:
        """A record whose handling failed: logged once at ERROR (with its coordinates and the
        traceback), dead-lettered at ``stage`` (default ``worker:<agent>``), counted."""
        stage = stage or f"worker:{agent}"
        log.error(
            "%s: dead-lettering %s: %s", stage, coordinates(msg), error_text(exc), exc_info=trace_of(exc)
        )
        await self.dead_letter(msg, error_text(exc), agent, stage)

    async def emit(self, ev: Event, topic: Topic | None = None) -> None:
        t = topic or topic_for(ev)
        key, value = t.key_of(ev), encode(ev)
        name = self.topic_name(t)
        headers = None
        if self.signer is not None and name in SIGNED_TOPICS:
            headers = self.signer.headers(name, key, value)
        await self.faust_topic(t).send(key=key, value=value, headers=headers)

    async def guard(
        self, event: Any, agent: str, body: Callable[[Event], Awaitable[None]], store: Any = None
    ) -> None:
        """Decode one event and run ``body`` on it; any exception dead-letters the event.

        ``store`` (a :class:`trainguard.streams.state.StageStore`): the stage's kept state is restored for the
        event's key first, an event already in that state is skipped, and what changed is written
        after.  Records of the event's partition the consumer skipped before it are read directly
        and handled first (:mod:`trainguard.streams.offsets`)."""
        msg = event.message
        if not self.offsets_ready.is_set():
            await self.offsets_ready.wait()
        self.in_guard[agent] = time.monotonic()
        try:
            gap = self.offsets.check(msg.topic, msg.partition, msg.offset)
            if gap is not None:
                await self.fill_gap(msg.topic, msg.partition, gap, msg.offset, agent, body, store)
                # This record is handled next: the one after it is expected (else every later
                # record would be taken for a gap and this one read and handled again).
                self.offsets.filled(msg.topic, msg.partition, msg.offset + 1)
            await self.handle(event, agent, body, store)
        finally:
            self.in_guard.pop(agent, None)

    def longest_in_guard_s(self) -> float:
        """How long the agent busiest with one record has been at it (0: none is)."""
        now = time.monotonic()
        return max((now - since for since in self.in_guard.values()), default=0.0)

    async def handle(
        self, event: Any, agent: str, body: Callable[[Event], Awaitable[None]], store: Any = None
    ) -> None:
        """:meth:`guard` without the gap check: one event (or one record read directly)."""
        ev = await self.decode(event, agent)
        if ev is None:
            self.metrics.processed(agent)
            return
        try:
            if store is None or await store.before(event):
                try:
                    await body(ev)
                finally:
                    if store is not None:
                        store.after(event)
        except Exception as exc:  # one poisoned event must never stop the agent
            await self.reject(event.message, agent, exc)
        self.metrics.processed(agent)

    async def fill_gap(
        self,
        topic: str,
        partition: int,
        start: int,
        end: int,
        agent: str,
        body: Callable[[Event], Awaitable[None]],
        store: Any = None,
    ) -> None:
        """Read the records ``start`` .. ``end - 1`` of a partition directly and handle them, in
        order: the consumer delivered ``end`` without them.  If they cannot be read (the broker
        away for ``FILL_TIMEOUT_S``, more than ``MAX_FILL_RECORDS``), what was not read is logged
        at ERROR and counted, never silently passed."""
        self.metrics.input_gaps.labels(agent).inc()
        log.warning(
            "%s: %s[%d] delivered offset %d without %d-%d (skipped by the consumer): reading them directly",
            agent, topic, partition, end, start, end - 1,
        )  # fmt: skip
        first = max(start, end - MAX_FILL_RECORDS)
        try:
            records = await asyncio.wait_for(self.read_range(topic, partition, first, end), FILL_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            records, first = [], end
            log.error("%s: reading %s[%d] %d-%d failed: %s", agent, topic, partition, start, end - 1, exc)
        if first > start:
            self.metrics.input_gap_unread.labels(agent).inc(first - start)
            log.error(
                "%s: offsets %d-%d of %s[%d] were skipped by the consumer and not read: not handled",
                agent, start, first - 1, topic, partition,
            )  # fmt: skip
        for rec in records:
            self.metrics.input_gap_records.labels(agent).inc()
            await self.handle(ReadRecord(rec), agent, body, store)
        self.offsets.filled(topic, partition, end)

    async def read_range(
        self, topic: str, partition: int, start: int, end: int, limit: int | None = None
    ) -> list[Any]:
        """The records at offsets ``start`` .. ``end - 1`` of one partition (fewer where the log
        has none: transaction markers; the first ``limit`` only), read with a client of this
        worker's own (no group)."""
        from aiokafka import AIOKafkaConsumer, TopicPartition

        tp = TopicPartition(topic, partition)
        consumer = AIOKafkaConsumer(
            **aiokafka_kwargs(self.settings.kafka),
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        out: list[Any] = []
        try:
            await consumer.start()
            consumer.assign([tp])
            consumer.seek(tp, start)
            while await consumer.position(tp) < end and (limit is None or len(out) < limit):
                batch = await consumer.getmany(tp, timeout_ms=1000, max_records=1000)
                out.extend(r for r in batch.get(tp, []) if start <= r.offset < end)
            return out if limit is None else out[:limit]
        finally:
            await consumer.stop()

    async def committed_offsets(self, partitions: set[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """The worker group's committed offsets of ``partitions`` (those it has; a separate
        client that never joins the group)."""
        from aiokafka import AIOKafkaConsumer, TopicPartition

        consumer = AIOKafkaConsumer(
            **aiokafka_kwargs(self.settings.kafka), group_id=self.cfg.app_id, enable_auto_commit=False
        )
        try:
            await consumer.start()
            out = {}
            for topic, partition in sorted(partitions):
                offset = await consumer.committed(TopicPartition(topic, partition))
                if offset is not None and offset >= 0:
                    out[(topic, partition)] = int(offset)
            return out
        finally:
            await consumer.stop()

    async def handle_followed(self, rec: Any, handle: Callable[[bytes | None], None], name: str) -> None:
        """One record of a followed topic: ``handle`` it; if it raises, the record is bad (it would
        fail again after any restart): dead-letter it at ``worker:<name>`` and go on.  A
        :class:`DecodeError` is garbage, logged here with its coordinates and dead-lettered by
        the sink (which reads every topic) or, without a sink, here at stage ``decode``."""
        why = authentic(self.verifier, rec)
        if why:  # every worker reads a followed topic: the sink dead-letters it once
            log.warning("%s: not authentic, skipping %s: %s", name, coordinates(rec), why)
            if not self.cfg.sink_enabled:
                await self.dead_letter(rec, why, name, "auth")
            return
        try:
            handle(rec.value)
        except DecodeError as exc:
            log.error("%s: skipping undecodable %s: %s", name, coordinates(rec), exc)
            if not self.cfg.sink_enabled:
                await self.dead_letter(rec, str(exc), name, "decode")
        except Exception as exc:
            await self.reject(rec, name, exc)

    def follow(
        self,
        topic: Topic,
        handle: Callable[[bytes | None], None],
        name: str,
        since_ms: Callable[[], int] | None = None,
    ) -> None:
        """Run ``handle`` on every record of ``topic`` on this worker, from the start of the topic
        (or from the first record at or after ``since_ms()``, evaluated at each (re)start).

        Not group-consumed: each worker reads every partition itself (no offsets committed), so
        what the topic says reaches every worker, whichever partitions its agents own.  If the
        broker goes away the reader starts over after a pause (``handle`` must be idempotent).
        A record ``handle`` raises on is dead-lettered (stage ``worker:<name>``) and passed: it is
        the record's fault, never a reason to start over (the same record would fail again).
        How far it got is the ``trainguard_follow_offset`` gauge (per partition, the offset of the
        next record to read: a record has been handled once the gauge has passed its offset).
        Records are handled in slices that give the event loop back in between: a long history
        read at start must not starve the agents or the consumer's heartbeats.
        """
        kafka, followed, name_ = self.settings.kafka, self.metrics.followed, self.topic_name(topic)

        async def read(backoff: Backoff) -> None:
            from aiokafka import AIOKafkaConsumer, TopicPartition

            consumer = AIOKafkaConsumer(**aiokafka_kwargs(kafka), group_id=None, enable_auto_commit=False)
            await consumer.start()
            try:
                parts = [TopicPartition(name_, p) for p in range(topic.partitions)]
                consumer.assign(parts)
                if since_ms is None:
                    await consumer.seek_to_beginning(*parts)
                else:
                    at = await consumer.offsets_for_times({tp: since_ms() for tp in parts})
                    for tp in parts:
                        found = at.get(tp)
                        if found is None:  # nothing that recent: from the end
                            await consumer.seek_to_end(tp)
                        else:
                            consumer.seek(tp, found.offset)
                backoff.reset()
                while True:
                    batches = await consumer.getmany(timeout_ms=1000, max_records=500)
                    for tp, records in batches.items():
                        for rec in records:
                            await self.handle_followed(rec, handle, name)
                        if records:
                            followed.labels(name_, str(tp.partition)).set(records[-1].offset + 1)
                    await asyncio.sleep(0)  # the agents and heartbeats get their turn
            finally:
                await consumer.stop()

        async def follower() -> None:
            backoff = Backoff(initial_s=1.0, max_s=30.0)
            while True:
                try:
                    await read(backoff)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the broker away: start over
                    delay = backoff.next_delay()
                    log.warning("%s: reading %s failed (%s); retrying in %.1fs", name, name_, exc, delay)
                    await asyncio.sleep(delay)

        follower.__name__ = f"follow_{name}"
        self.app.task(follower)
