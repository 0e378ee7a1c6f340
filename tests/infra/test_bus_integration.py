"""Kafka -> ClickHouse on the real local broker and server: no mocks anywhere."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import pytest

from tests.infra.events import one_of_each
from tests.waiting import wait_until
from trainguard.infra.bus import EventConsumer, EventProducer, seed_group_offsets, signer_for
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.config import Settings
from trainguard.infra.sink import Sink, SinkConfig
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import DeadLetter
from trainguard.schemas.topics import DEAD_LETTERS, LOGS, TOPICS
from trainguard.schemas.workload import LogLine

pytestmark = pytest.mark.slow


def _consume_until(
    consumer: EventConsumer, done: Callable[[list, list], bool], timeout_s: float = 60.0
) -> tuple[list, list]:  # type: ignore[type-arg]
    """Consume (a new group reads the topics' whole history) until ``done(events, dead)``."""
    events: list = []  # type: ignore[type-arg]
    dead: list = []  # type: ignore[type-arg]

    def finished() -> bool:
        if done(events, dead):
            return True
        batch = consumer.poll(timeout_ms=500)
        events.extend(batch.events)
        dead.extend(batch.dead_letters)
        return done(events, dead)

    wait_until(
        finished,
        timeout_s,
        lambda: f"the events awaited (read {len(events)} events, {len(dead)} dead letters)",
        interval_s=0,
    )
    return events, dead


def _join_at_end(consumer: EventConsumer) -> None:
    """Wait until ``consumer`` has its partitions and knows its positions at their ends (so what is
    produced next is read, and nothing before it)."""
    kafka = consumer._consumer
    wait_until(lambda: consumer.poll(timeout_ms=200) is not None and kafka.assignment(), 60, "an assignment")
    for tp in kafka.assignment():
        kafka.position(tp)


def test_produce_consume_store_and_query_back(stack_settings: Settings) -> None:
    job = f"it-{uuid.uuid4().hex[:8]}"
    events = [e for e in one_of_each(job, now_ms()) if not isinstance(e, DeadLetter)]
    producer = EventProducer(stack_settings.kafka, signer=signer_for(stack_settings, "operator"))
    topics = sorted({t.name for t in TOPICS if t is not DEAD_LETTERS})
    # A new group at the end of the topics, joined before we produce: the stack's history (every
    # earlier test and demo run) is not this test's business and can be large.
    consumer = EventConsumer(
        stack_settings.kafka, topics, group_id=f"it-{job}", producer=producer, auto_offset_reset="latest"
    )
    try:
        _join_at_end(consumer)
        for ev in events:
            producer.send(ev)
        producer.flush()
        # A running stream worker may add its own detections for this job: look for ours.
        got, dead = _consume_until(consumer, lambda ev, _d: all(e in ev for e in events))
        mine = [e for e in got if e in events]
        assert sorted(type(e).__name__ for e in mine) == sorted(type(e).__name__ for e in events)
        assert not [d for d in dead if d.key == job]
        store = ClickHouseStore(stack_settings.clickhouse)
        store.insert_events(mine)
        consumer.commit()
        assert store.count("training_steps", "job = %(j)s", {"j": job}) == 1
        row = store.query_dicts(
            "SELECT node, gpu, state, temperature_c FROM gpu_samples FINAL WHERE job = %(j)s ORDER BY gpu",
            {"j": job},
        )
        assert [(r["gpu"], r["state"]) for r in row] == [(0, "ok"), (1, "lost")]
        assert store.count("decisions", "decision_id = %(d)s", {"d": f"{job}-dec"}) == 1
        store.close()
    finally:
        consumer.close()
        producer.close()


def test_garbage_on_every_topic_ends_in_the_dead_letter_topic_and_table(stack_settings: Settings) -> None:
    tag = f"garbage-{uuid.uuid4().hex[:8]}"
    producer = EventProducer(stack_settings.kafka, signer=signer_for(stack_settings, "operator"))
    inputs = [t for t in TOPICS if t is not DEAD_LETTERS]
    # inputs[0] is the GPU topic: it gets a gpu_batch of an unknown version.
    payloads = [
        b'{"schema": "gpu_batch", "version": 99}',
        b"\xff\xfe not utf8",
        b"{not json",
        b'{"schema": "nope", "version": 1}',
        b'{"schema": "gpu_batch", "version": 1}',
    ]
    for i, t in enumerate(inputs):
        producer.send_raw(t.name, payloads[i % len(payloads)], key=tag.encode())
    producer.flush()
    group = f"dlq-{tag}"
    consumer = EventConsumer(
        stack_settings.kafka, [t.name for t in inputs], group_id=group, producer=producer
    )
    try:
        _, dead = _consume_until(consumer, lambda _e, dl: sum(d.key == tag for d in dl) >= len(inputs))
        mine = [d for d in dead if d.key == tag]
        assert sorted(d.topic for d in mine) == sorted(t.name for t in inputs)
        assert all(d.reason for d in mine)
        assert any(d.payload_b64 for d in mine)  # the non-UTF-8 bytes are kept, base64
        consumer.commit()
    finally:
        consumer.close()
    # The dead letters were published: a sink reading the DLQ topic stores them in ClickHouse.
    sink = Sink(
        stack_settings, SinkConfig(group_id=f"sink-{tag}", max_wait_s=0.2), topics=[DEAD_LETTERS.name]
    )
    store = ClickHouseStore(stack_settings.clickhouse)
    stop = threading.Event()
    runner = threading.Thread(target=sink.run, args=(stop.is_set,), daemon=True)
    runner.start()
    try:
        wait_until(
            lambda: store.count("dead_letters", "key = %(k)s", {"k": tag}) >= len(inputs),
            30,
            f"{len(inputs)} dead letters keyed {tag} in ClickHouse",
        )
    finally:
        stop.set()
        runner.join(30)
        sink.close()
    assert store.count("dead_letters", "key = %(k)s", {"k": tag}) == len(inputs)
    reasons = {
        r[0] for r in store.query("SELECT reason FROM dead_letters FINAL WHERE key = %(k)s", {"k": tag})
    }
    assert any("not UTF-8" in r for r in reasons) and any("unknown version 99" in r for r in reasons)
    assert any("on this topic, got 'gpu_batch'" in r for r in reasons)
    producer.close()
    store.close()


def test_a_new_group_starts_at_its_start_time_not_at_the_topics_beginning(stack_settings: Settings) -> None:
    """An action service with a new group reads the decisions it would still act on, not a month
    of history first: the group's offsets are seeded at the first record from ``start_ms``."""
    node = f"it-{uuid.uuid4().hex[:8]}"
    producer = EventProducer(stack_settings.kafka)
    topic = LOGS.name

    def lines(tag: str) -> list[LogLine]:
        return [
            LogLine(node=node, ts_ms=now_ms(), source="kernel", line=f"{tag} {i}", seq=i) for i in range(3)
        ]

    try:
        for ev in lines("old"):
            producer.send(ev)
        producer.flush()
        time.sleep(1.5)  # record timestamps are milliseconds: a clear gap between the batches
        start = now_ms()
        time.sleep(0.2)
        for ev in lines("new"):
            producer.send(ev)
        producer.flush()
        group = f"it-start-{node}"
        consumer = EventConsumer(stack_settings.kafka, [topic], group_id=group, start_ms=start)
        try:
            got, _ = _consume_until(
                consumer, lambda ev, _d: sum(isinstance(e, LogLine) and e.node == node for e in ev) >= 3
            )
            mine = sorted(e.line for e in got if isinstance(e, LogLine) and e.node == node)
            assert mine == ["new 0", "new 1", "new 2"]  # nothing older than the start
            consumer.commit()
        finally:
            consumer.close()
        # The group has offsets now: a restart carries on from them, nothing is seeded again.
        assert seed_group_offsets(stack_settings.kafka, group, [topic], start) == {}
    finally:
        producer.close()
