"""Detector state that survives a worker restart and a rebalance: one compacted changelog topic
per stateful stage (:data:`trainguard.detectors.keyed_state.STATEFUL`), ``<app_id>-state-<stage>-changelog``.

A stage's state is kept per key of its input (a node's rule windows, a job's monitor), so it
lives with the input partition: the changelog has the input's partition count and each key's
state goes to the changelog partition of the key's input partition.  After every assignment (a
start, a rebalance) the worker reads the changelog partitions of the input partitions it now owns
to their end and restores every key in them (:meth:`WorkerState.restore`) -- eagerly, because a
hung job sends nothing that would bring its monitor back -- and the agents wait for that before
their next event (:meth:`StageStore.before`).

Why not Faust tables: with a table, Faust's recovery re-seeks every stream partition when it
resumes them, and in the chaos suite's worker-kill scenario (``bench/chaos.py``) one Xid line in
300 sent during the rebalance was never processed (2 runs in 3); with the changelog read here and
Faust's plain rebalance path, none was lost.

What is written: every ``state_flush_s``, the state document of each key whose state changed
(:meth:`trainguard.detectors.keyed_state.PathState.take_dirty`), together with the input offset of the last
event applied to it -- after the worker's producer has flushed, so everything those events
emitted is in Kafka first (:meth:`WorkerState.flush`).  An event at or below that offset was
applied before the state was written: after a restart it is skipped, so a redelivered NIC flap is
not counted twice in its window (Kafka delivery is at-least-once), and its detection or decision
was not lost.  Before a partition is given up the worker writes everything changed and flushes,
so the next owner's recovery sees it.

A state document that does not restore (garbage on the changelog, another version, a class not
allowed: :mod:`trainguard.detectors.state`) is logged and skipped: the key starts from empty, as it would
have without a changelog.  The changelog topics are compacted; ``trainguard worker`` creates them
(:func:`changelog_topics`) because Faust is not allowed to create topics.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from typing import Any

import orjson

from trainguard.detectors.keyed_state import STATEFUL, PathState
from trainguard.detectors.routing import INPUTS
from trainguard.detectors.state import StateError
from trainguard.infra.backoff import Backoff
from trainguard.infra.config import KafkaConfig
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.topics import Topic
from trainguard.streams.context import WorkerContext
from trainguard.streams.kafka_compat import aiokafka_kwargs

log = logging.getLogger(__name__)


def changelog_name(app_id: str, stage: str) -> str:
    return f"{app_id}-state-{stage}-changelog"


def changelog_topics(app_id: str, kafka: KafkaConfig | None = None) -> list[Topic]:
    """The changelog topics of a worker group's state tables (compacted, kept forever), with as
    many partitions as their stage's input topics in ``kafka`` (the registry's without it)."""
    kafka = kafka or KafkaConfig()
    return [
        Topic(
            changelog_name(app_id, stage),
            Event,
            "",
            kafka.partitions(INPUTS[stage][0]),
            retention_ms=-1,
            max_message_bytes=8 * 1_048_576,
            doc=f"state of the {stage} stage",
            extra_configs={"cleanup.policy": "compact"},
        )
        for stage in STATEFUL
    ]


class StageStore:
    """One stage's table and what this worker knows of it (see the module docstring)."""

    def __init__(self, ctx: WorkerContext, state: PathState, stage: str) -> None:
        self.ctx, self.state, self.stage = ctx, state, stage
        self.topics = {ctx.topic_name(t) for t in INPUTS[stage]}
        self.partitions = ctx.settings.kafka.partitions(INPUTS[stage][0])
        self.changelog = changelog_name(ctx.cfg.app_id, stage)
        self.topic = ctx.raw_topic(self.changelog, self.partitions)
        self.ready = asyncio.Event()  # shared by every stage (WorkerState)
        #: key -> input partition it comes from (its changelog partition).
        self.partition_of: dict[str, int] = {}
        #: key -> input topic -> offset of the last event applied to its state.
        self.applied: dict[str, dict[str, int]] = {}
        #: keys restored at the last assignment (every key of the changelog partitions owned).
        self.loaded: set[str] = set()
        self.dirty: set[str] = set()
        #: key -> when its "too large to keep" error was last logged (once per 10 minutes).
        self._too_large_logged: dict[str, float] = {}
        #: the key whose event is being handled: its state may be half-changed, its output not
        #: yet queued, so it is not written until the event is done.
        self.inflight: str | None = None
        #: >0 while a timer of the stage changes state and emits (the whole stage waits).
        self.busy = 0

    # -- around each event --------------------------------------------------------------------

    async def before(self, event: Any) -> bool:
        """Prepare ``event``'s key; False if the event is already in the stored state (skip it)."""
        await self.ready.wait()  # the state of this assignment is restored first
        key = _key(event)
        if key is None:
            return True
        msg = event.message
        self.partition_of[key] = msg.partition
        done = self.applied.get(key, {}).get(msg.topic)
        if done is not None and msg.offset <= done:
            return False
        self.inflight = key
        return True

    def after(self, event: Any) -> None:
        """``event`` is done with (handled or dead-lettered): its key may be written again."""
        key = _key(event)
        if key is not None:
            self.applied.setdefault(key, {})[event.message.topic] = event.message.offset
        self.inflight = None

    # -- writing ------------------------------------------------------------------------------

    def collect(self) -> list[tuple[str, int, bytes]]:
        """The changed keys' state records (key, changelog partition, value), taken now: no await
        between the snapshot and the applied offsets it is written with."""
        self.dirty |= self.state.take_dirty(self.stage)
        if self.busy:
            return []
        out = []
        for key in list(self.dirty):
            if key == self.inflight:
                continue
            part = self.partition_of.get(key)
            if part is None:  # changed by a timer before any event of it was seen here
                continue
            self.dirty.discard(key)
            try:
                value = pack_record(
                    orjson.dumps(
                        {"p": part, "o": self.applied.get(key, {}), "s": self.state.snapshot(self.stage, key)}
                    )
                )
            except (StateError, ValueError, TypeError) as exc:  # a detector holding the unstorable
                log.error("state of %s %s not stored: %s", self.stage, key, exc)
                continue
            if len(value) > MAX_RECORD_BYTES:
                self.ctx.metrics.state_too_large.labels(self.stage).inc()
                if time.monotonic() - self._too_large_logged.get(key, -1e9) > 600:
                    self._too_large_logged[key] = time.monotonic()
                    log.error(
                        "state of %s %s is %d bytes compressed, over the %d-byte record limit: not kept "
                        "(after a restart or a move its detectors start empty)",
                        self.stage, key, len(value), MAX_RECORD_BYTES,
                    )  # fmt: skip
                continue
            out.append((key, part, value))
        return out

    async def write(self, records: list[tuple[str, int, bytes]]) -> None:
        for i, (key, part, value) in enumerate(records):
            try:
                await self.topic.send(key=key.encode(), value=value, partition=part)
            except Exception as exc:  # never a crash of the worker: those keys are written next time
                log.warning("state of %s not written (%s): retried at the next flush", self.stage, exc)
                self.dirty |= {k for k, _, _ in records[i:]}
                return
            self.ctx.metrics.state_writes.labels(self.stage).inc()

    # -- rebalances ---------------------------------------------------------------------------

    def owned(self, assigned: set[tuple[str, int]]) -> set[int]:
        return {p for (topic, p) in assigned if topic in self.topics}

    def reset(self, records: dict[str, bytes]) -> list[Any]:
        """Forget every key, then restore each key of ``records`` (the changelog partitions owned
        now, latest record per key).  Returns the commands to send again (pending captures)."""
        for key in self.state.keys(self.stage) | self.loaded:
            self.state.drop(self.stage, key)
        self.loaded.clear()
        self.applied.clear()
        self.dirty.clear()
        out: list[Any] = []
        for key, raw in records.items():
            self.loaded.add(key)
            out += self._restore_now(key, raw)
        return out

    def _restore_now(self, key: str, raw: bytes) -> list[Any]:
        try:
            rec = orjson.loads(unpack_record(raw))
            if not isinstance(rec, dict) or not isinstance(rec.get("s"), str):
                raise StateError("not a state record")
            commands = self.state.restore(self.stage, key, rec["s"], now_ms())
            offsets = rec.get("o") or {}
            self.applied[key] = {str(t): int(o) for t, o in offsets.items()}
            if isinstance(rec.get("p"), int):
                self.partition_of[key] = rec["p"]
        except (StateError, ValueError, TypeError, KeyError, AttributeError) as exc:
            log.error("state of %s %s not restored (starting from empty): %s", self.stage, key, exc)
            self.state.drop(self.stage, key)
            return []
        self.ctx.metrics.state_restores.labels(self.stage).inc()
        return commands


#: a state record larger than this is compressed (zlib; marked by a leading ``Z``)...
COMPRESS_OVER_BYTES = 64 * 1024
#: ...and one still larger than this is not written: Kafka refuses records over its 1 MB default
#: (``max.request.size``), and a refused send inside a Faust timer crashed the whole worker
#: (a 19,200-rank job's monitor was 1.05 MB).  Logged, counted, and the key restarts empty
#: after a move instead.
MAX_RECORD_BYTES = 900 * 1024
#: the most a compressed record may inflate to (a document is small; a bomb is not ours).
MAX_INFLATED_BYTES = 64 * 1024 * 1024


def pack_record(value: bytes) -> bytes:
    """A state record as written: compressed when large.

    >>> unpack_record(pack_record(b'{"s": "x"}')) == b'{"s": "x"}'
    True
    >>> big = b'{"s": "' + b"1234567890" * 10_000 + b'"}'
    >>> packed = pack_record(big); packed[:1], len(packed) < len(big) // 10, unpack_record(packed) == big
    (b'Z', True, True)
    """
    if len(value) <= COMPRESS_OVER_BYTES:
        return value
    return b"Z" + zlib.compress(value, 1)


def unpack_record(raw: bytes) -> bytes:
    """The JSON of a record :func:`pack_record` wrote; :class:`StateError` for a bad one."""
    if not raw.startswith(b"Z"):
        return raw
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(raw[1:], MAX_INFLATED_BYTES)
    except zlib.error as exc:
        raise StateError(f"bad compressed state record: {exc}") from None
    if inflater.unconsumed_tail:
        raise StateError(f"compressed state record inflates past {MAX_INFLATED_BYTES} bytes")
    return out


def _key(event: Any) -> str | None:
    key = event.key
    if isinstance(key, bytes) and key:
        return key.decode(errors="replace")
    return None


class WorkerState:
    """The stores of every stateful stage, wired to the app's rebalance signals."""

    def __init__(self, ctx: WorkerContext, state: PathState) -> None:
        self.ctx, self.state = ctx, state
        self.stores = {stage: StageStore(ctx, state, stage) for stage in STATEFUL}
        #: set once the state of the current assignment is restored; the agents wait for it.
        self.ready = asyncio.Event()
        self.generation = 0
        self._restoring: asyncio.Future[None] | None = None
        for store in self.stores.values():
            store.ready = self.ready
        app = ctx.app

        @app.on_partitions_revoked.connect
        async def on_revoked(app_: Any, revoked: Any, **_: Any) -> None:
            # Faust has drained the agents by now.  What changed goes out (the next owner reads
            # it), and no event is handled until the next assignment's state is restored.
            self.ready.clear()
            await self.flush(final=True)

        @app.on_partitions_assigned.connect
        async def on_assigned(app_: Any, assigned: Any, **_: Any) -> None:
            self.ready.clear()
            self.generation += 1
            owned = {(tp.topic, tp.partition) for tp in assigned}
            if self._restoring is not None:
                self._restoring.cancel()  # an older assignment's: this one replaces it
            # In a task of its own: the rebalance callback returns at once (reading a large
            # changelog must not hold up the group); the agents wait for ``ready``.
            self._restoring = asyncio.ensure_future(self.restore(owned, self.generation))

        @app.timer(ctx.cfg.state_flush_s)
        async def flush_state() -> None:
            await self.flush()

    async def restore(self, assigned: set[tuple[str, int]], generation: int) -> None:
        """Read the changelog partitions of ``assigned`` to their end and restore every stage from
        them; then let the agents go on.  Retried while the broker is away."""
        backoff = Backoff(initial_s=0.5, max_s=10.0)
        while generation == self.generation:
            try:
                records = await self._read(assigned)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the broker away: the agents wait, the state is not guessed
                delay = backoff.next_delay()
                log.warning("reading worker state failed (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
        else:
            return  # a newer assignment restores instead
        if generation != self.generation:
            return
        for stage, store in self.stores.items():
            for cmd in store.reset(records[stage]):
                try:
                    await self.ctx.emit(cmd)
                except Exception as exc:
                    log.error("could not ask again for the stacks of a restored capture: %s", exc)
        self.ready.set()
        log.info("state restored (keys per stage): %s", {s: len(st.loaded) for s, st in self.stores.items()})

    async def _read(self, assigned: set[tuple[str, int]]) -> dict[str, dict[str, bytes]]:
        """stage -> key -> latest record, from the changelog partitions of ``assigned``."""
        from aiokafka import AIOKafkaConsumer, TopicPartition

        want = {
            TopicPartition(store.changelog, p): stage
            for stage, store in self.stores.items()
            for p in store.owned(assigned)
        }
        out: dict[str, dict[str, bytes]] = {stage: {} for stage in self.stores}
        if not want:
            return out
        consumer = AIOKafkaConsumer(
            **aiokafka_kwargs(self.ctx.settings.kafka), group_id=None, enable_auto_commit=False
        )
        await consumer.start()
        try:
            consumer.assign(list(want))
            await consumer.seek_to_beginning(*want)
            end = await consumer.end_offsets(list(want))
            left = {tp for tp in want if end[tp] > 0}
            while left:
                batches = await consumer.getmany(*left, timeout_ms=1000, max_records=2000)
                for tp, recs in batches.items():
                    for rec in recs:
                        if rec.key is not None:
                            key = rec.key.decode(errors="replace")
                            if rec.value is None:
                                out[want[tp]].pop(key, None)
                            else:
                                out[want[tp]][key] = rec.value
                for tp in list(left):
                    if await consumer.position(tp) >= end[tp]:
                        left.discard(tp)
        finally:
            await consumer.stop()
        return out

    async def flush(self, final: bool = False) -> None:
        """Write every stage's changed state -- after the producer has flushed.

        A state record says "events up to offset N are in here", and after a restart those events
        are skipped.  So the decisions and detections those events produced must be in Kafka
        before the record is: the snapshot is taken first (with its offsets, no await between),
        then the producer is flushed (everything emitted so far is acknowledged), then the
        records are sent.  Killed in between, the state is simply older and the events are
        processed again (at-least-once), never skipped with their output lost.
        """
        records = {stage: store.collect() for stage, store in self.stores.items()}
        if not any(records.values()):
            return
        try:
            await self.ctx.app.producer.flush()
        except Exception as exc:  # the broker away: keep the keys dirty, try again next round
            log.warning("state not written (outputs not flushed: %s)", exc)
            for stage, recs in records.items():
                self.stores[stage].dirty |= {key for key, _, _ in recs}
            return
        for stage, recs in records.items():
            await self.stores[stage].write(recs)
        if final:
            try:
                await self.ctx.app.producer.flush()
            except Exception as exc:  # the next owner recovers what reached the broker
                log.warning("flushing state before a rebalance failed: %s", exc)

    def touch(self, stage: str, key: str) -> None:
        """``key``'s state in ``stage`` changed (what only the caller knows: a step, a timer)."""
        self.state.touch(stage, key)

    def store(self, stage: str) -> StageStore | None:
        return self.stores.get(stage)
