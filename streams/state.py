"""Detector state that survives a worker restart and a rebalance: one changelog-backed Faust table
per stateful stage (:data:`detectors.keyed_state.STATEFUL`).

A stage's state is kept per key of its input (a node's rule windows, a job's monitor), so it
lives with the input partition: the table ``state-<stage>`` has the input's partition count and
each key's state goes to the changelog partition of the key's input partition.  Faust recovers a
worker's active changelog partitions before its agents resume (after a start and after every
rebalance), and then :meth:`StageStore.on_recovered` restores every key of the partitions this
worker now owns -- eagerly, because a hung job sends nothing that would bring its monitor back.

What is written: after an event that changed a key's state (:meth:`detectors.keyed_state.PathState.
take_dirty`), the key's state document, at most once per ``state_flush_s`` per key (the rest on a
timer), together with the input offset of the last event applied to it.  An event at or below
that offset was applied before the state was written: after a restart it is skipped, so a
redelivered NIC flap is not counted twice in its window (Kafka delivery is at-least-once).
Before a partition is given up the worker writes everything changed and flushes its producer,
so the next owner's recovery sees it.

A state document that does not restore (garbage on the changelog, another version, a class not
allowed: :mod:`detectors.state`) is logged and skipped: the key starts from empty, as it would
have without a changelog.  The changelog topics are compacted; ``trainguard worker`` creates them
(:func:`changelog_topics`) because Faust is not allowed to create topics.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from detectors.keyed_state import STATEFUL, PathState
from detectors.routing import INPUTS
from detectors.state import StateError
from schemas.base import Event, now_ms
from schemas.topics import Topic
from streams.context import WorkerContext

log = logging.getLogger(__name__)


def table_name(stage: str) -> str:
    return f"state-{stage}"


def changelog_topics(app_id: str) -> list[Topic]:
    """The changelog topics of a worker group's state tables (compacted, kept forever)."""
    return [
        Topic(
            f"{app_id}-{table_name(stage)}-changelog",
            Event,
            "",
            INPUTS[stage][0].partitions,
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
        self.table = ctx.app.Table(
            table_name(stage),
            partitions=INPUTS[stage][0].partitions,
            key_type=bytes,  # raw bytes both ways (Faust picks the raw serializer for bytes)
            value_type=bytes,
        )
        #: key -> input partition it comes from (its changelog partition).
        self.partition_of: dict[str, int] = {}
        #: key -> input topic -> offset of the last event applied to its state.
        self.applied: dict[str, dict[str, int]] = {}
        #: keys looked up in the table since the last rebalance.
        self.loaded: set[str] = set()
        self.dirty: set[str] = set()
        self.last_write: dict[str, float] = {}
        self.flush_s = ctx.cfg.state_flush_s
        self.restored = 0
        self.bad = 0

    # -- around each event --------------------------------------------------------------------

    async def before(self, event: Any) -> bool:
        """Prepare ``event``'s key; False if the event is already in the stored state (skip it)."""
        key = _key(event)
        if key is None:
            return True
        msg = event.message
        self.partition_of[key] = msg.partition
        if key not in self.loaded:
            self.loaded.add(key)
            raw = self.table.data.get(key.encode())
            if raw is not None:
                await self._restore(key, raw)
        done = self.applied.get(key, {}).get(msg.topic)
        return done is None or msg.offset > done

    async def after(self, event: Any) -> None:
        key = _key(event)
        if key is not None:
            self.applied.setdefault(key, {})[event.message.topic] = event.message.offset
        await self.flush(due_only=True)

    # -- writing ------------------------------------------------------------------------------

    async def flush(self, due_only: bool = False) -> None:
        """Write the changed keys' state (``due_only``: those not written within ``flush_s``)."""
        self.dirty |= self.state.take_dirty(self.stage)
        if not self.dirty:
            return
        now = time.monotonic()
        for key in list(self.dirty):
            if due_only and now - self.last_write.get(key, 0.0) < self.flush_s:
                continue
            part = self.partition_of.get(key)
            if part is None:  # changed by a timer before any event of it was seen here
                continue
            self.dirty.discard(key)
            self.last_write[key] = now
            try:
                value = json.dumps(
                    {"p": part, "o": self.applied.get(key, {}), "s": self.state.snapshot(self.stage, key)}
                ).encode()
            except (StateError, ValueError, TypeError) as exc:  # a detector holding the unstorable
                log.error("state of %s %s not stored: %s", self.stage, key, exc)
                continue
            self.table.data[key.encode()] = value
            self.table.send_changelog(part, key.encode(), value)
            self.ctx.metrics.state_writes.labels(self.stage).inc()

    # -- rebalances ---------------------------------------------------------------------------

    async def on_revoked(self) -> None:
        """Before partitions move: write everything changed (the next owner recovers it)."""
        await self.flush()

    def on_recovered(self, assigned: set[tuple[str, int]]) -> list[Any]:
        """After recovery: forget every key, then restore each key of the partitions owned now.

        Returns the commands to send again (restored pending captures)."""
        parts = {p for (topic, p) in assigned if topic in self.topics}
        for key in self.state.keys(self.stage) | self.loaded:
            self.state.drop(self.stage, key)
        self.loaded.clear()
        self.applied.clear()
        self.dirty.clear()
        out: list[Any] = []
        for raw_key, raw in list(self.table.data.items()):
            key = raw_key.decode(errors="replace")
            try:
                part = json.loads(raw)["p"]
            except (ValueError, TypeError, KeyError):
                part = None
            if part in parts:
                self.loaded.add(key)
                out += self._restore_now(key, raw)
        return out

    async def _restore(self, key: str, raw: bytes) -> None:
        for cmd in self._restore_now(key, raw):
            await self.ctx.emit(cmd)

    def _restore_now(self, key: str, raw: bytes) -> list[Any]:
        try:
            rec = json.loads(raw)
            if not isinstance(rec, dict) or not isinstance(rec.get("s"), str):
                raise StateError("not a state record")
            commands = self.state.restore(self.stage, key, rec["s"], now_ms())
            offsets = rec.get("o") or {}
            self.applied[key] = {str(t): int(o) for t, o in offsets.items()}
            if isinstance(rec.get("p"), int):
                self.partition_of[key] = rec["p"]
        except (StateError, ValueError, TypeError, KeyError, AttributeError) as exc:
            self.bad += 1
            log.error("state of %s %s not restored (starting from empty): %s", self.stage, key, exc)
            self.state.drop(self.stage, key)
            return []
        self.restored += 1
        self.ctx.metrics.state_restores.labels(self.stage).inc()
        return commands


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
        app = ctx.app

        @app.on_partitions_revoked.connect
        async def on_revoked(app_: Any, revoked: Any, **_: Any) -> None:
            for store in self.stores.values():
                await store.on_revoked()
            try:
                await app.producer.flush()
            except Exception as exc:  # the broker away: the next owner recovers what reached it
                log.warning("flushing state before a rebalance failed: %s", exc)

        @app.on_rebalance_complete.connect
        async def on_recovered(app_: Any, **_: Any) -> None:
            assigned = {(tp.topic, tp.partition) for tp in app.consumer.assignment()}
            for store in self.stores.values():
                for cmd in store.on_recovered(assigned):
                    await ctx.emit(cmd)
            log.info(
                "state restored after a rebalance (keys per stage): %s",
                {s: len(st.loaded) for s, st in self.stores.items()},
            )

        @app.timer(ctx.cfg.state_flush_s)
        async def flush_state() -> None:
            for store in self.stores.values():
                await store.flush(due_only=True)

    def touch(self, stage: str, key: str) -> None:
        """``key``'s state in ``stage`` changed (what only the caller knows: a step, a timer)."""
        self.state.touch(stage, key)

    def store(self, stage: str) -> StageStore | None:
        return self.stores.get(stage)
