"""The sink's batch writer on both engines: refused events are isolated and dead-lettered, the rest
of the batch is stored, and a batch refused only for its shape is split until it goes in.

The poisoned events are built in Python (dataclasses do not validate): the codec would refuse
most of them before a sink sees them, and this is the net behind it.
"""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace
from typing import Any

import pytest

from trainguard.infra.clickhouse.store import ClickHouseStore, StoreError
from trainguard.infra.sink import BatchWriter
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.codec import to_dict
from trainguard.schemas.control import DeadLetter, Decision, Targets
from trainguard.schemas.enums import Action
from trainguard.schemas.topics import topic_for
from trainguard.schemas.workload import TrainingStep

DAY_MS = 86_400_000


def _record(event: Event, offset: int) -> SimpleNamespace:
    """What the consumer hands the sink with each event (a kafka-python ConsumerRecord's fields)."""
    topic = topic_for(event)
    value = json.dumps(to_dict(event), default=str).encode()  # ASCII: a lone surrogate is escaped
    return SimpleNamespace(topic=topic.name, partition=1, offset=offset, key=topic.key_of(event), value=value)


def _decision(job: str, i: int, ts_ms: int, ranks: list[int]) -> Decision:
    return Decision(
        decision_id=f"{job}-dec{i}",
        ts_ms=ts_ms,
        job=job,
        action=Action.RESTART,
        targets=Targets(machines=["m1"], ranks=ranks),
        reason="test",
    )


def _write(store: ClickHouseStore, events: list[Event]) -> tuple[Any, list[DeadLetter]]:
    published: list[DeadLetter] = []
    out = BatchWriter(store, published.extend).write([(_record(e, i), e) for i, e in enumerate(events)])
    return out, published


def test_refused_events_are_dead_lettered_and_the_rest_stored(store: ClickHouseStore) -> None:
    job = f"poison-{uuid.uuid4().hex[:6]}"
    t0 = now_ms()
    good_steps = [TrainingStep(job=job, rank=0, step=i, ts_ms=t0 + i, loss=1.0) for i in range(40)]
    good_decisions = [_decision(job, i, t0, [0, 1]) for i in range(5)]
    poison = {
        # A rank past Array(Int32): the client cannot serialize it.
        "range": _decision(job, 99, t0, [2**40]),
        # 2128: past DateTime's range (2106).
        "datetime": TrainingStep(job=job, rank=1, step=0, ts_ms=5_000 * 10**9, loss=1.0),
        # A lone surrogate cannot be UTF-8.
        "text": TrainingStep(job=job, rank=2, step=0, ts_ms=t0, node="gpu\ud800node"),
        # ts_ms so large that the mapper's datetime raises: dead-lettered without an insert.
        "mapping": TrainingStep(job=job, rank=3, step=0, ts_ms=2**62, loss=1.0),
    }
    events: list[Event] = [*good_steps[:13], poison["range"], *good_steps[13:20], poison["datetime"]]
    events += [*good_decisions[:2], poison["text"], *good_steps[20:], poison["mapping"], *good_decisions[2:]]
    offsets = {name: events.index(ev) for name, ev in poison.items()}

    out, published = _write(store, events)

    assert store.count("training_steps", "job = %(j)s", {"j": job}) == 40
    assert store.count("decisions", "job = %(j)s", {"j": job}) == 5
    assert out.rows["training_steps"] == 40 and out.rows["decisions"] == 5
    assert published == out.dead_letters and out.dropped == 0
    dead = {d.offset: d for d in out.dead_letters}
    assert sorted(dead) == sorted(offsets.values())
    stages = {name: dead[o].stage for name, o in offsets.items()}
    assert stages == {
        "range": "sink:decisions",
        "datetime": "sink:training_steps",
        "text": "sink:training_steps",
        "mapping": "sink:training_steps",
    }
    reasons = {name: dead[o].reason for name, o in offsets.items()}
    assert "insert into decisions failed" in reasons["range"] and "2147483647" in reasons["range"]
    assert "4294967295" in reasons["datetime"]  # the serializer's own range of a DateTime
    assert "surrogates not allowed" in reasons["text"]
    assert reasons["mapping"].startswith("row mapping failed: ValueError: year")
    for name, o in offsets.items():  # each keeps the record's coordinates and original bytes
        d = dead[o]
        assert d.topic == topic_for(poison[name]).name and d.partition == 1 and not d.payload_b64
        assert json.loads(d.payload)["job"] == job
    stored = store.query(
        "SELECT offset, stage, reason FROM dead_letters FINAL WHERE stage LIKE 'sink:%%' AND key = %(j)s",
        {"j": job},
    )
    assert {(int(o), s, r) for o, s, r in stored} == {(d.offset, d.stage, d.reason) for d in out.dead_letters}


def test_dead_lettering_again_after_a_redelivery_does_not_double(store: ClickHouseStore) -> None:
    job = f"again-{uuid.uuid4().hex[:6]}"
    events: list[Event] = [_decision(job, 0, now_ms(), [0]), _decision(job, 1, now_ms(), [2**40])]
    _write(store, events)
    _write(store, events)  # the batch read again: same record coordinates, same stage
    assert store.count("decisions", "job = %(j)s", {"j": job}) == 1
    assert store.count("dead_letters", "key = %(j)s AND stage = 'sink:decisions'", {"j": job}) == 1


def test_a_refused_dead_letter_of_the_sink_is_not_dead_lettered_again(store: ClickHouseStore) -> None:
    # A dead letter the sink made, refused when read back from the dead-letter topic: another
    # dead letter of it would go round the topic forever.  It is logged and counted, and acked.
    # (partition is an Int32 column: 2**40 cannot be stored.)
    ours = DeadLetter(ts_ms=now_ms(), topic="t", reason="r", stage="sink:decisions", partition=2**40)
    theirs = DeadLetter(ts_ms=now_ms(), topic="t", reason="r", stage="decode", partition=2**40)
    out, published = _write(store, [ours, theirs])
    assert out.dropped == 1
    assert [(d.stage, d.offset) for d in published] == [("sink:dead_letters", 1)]


def test_a_batch_over_too_many_partitions_is_split_until_it_goes_in(store: ClickHouseStore) -> None:
    # One step a day for 150 days: more partitions than one insert may touch on modern servers
    # (max_partitions_per_insert_block = 100); halves of it go in.
    job = f"days-{uuid.uuid4().hex[:6]}"
    t0 = now_ms() - 200 * DAY_MS
    steps: list[Event] = [TrainingStep(job=job, rank=0, step=i, ts_ms=t0 + i * DAY_MS) for i in range(150)]
    out, published = _write(store, steps)
    assert published == [] and out.rows == {"training_steps": 150}
    assert store.count("training_steps", "job = %(j)s", {"j": job}) == 150


def test_a_table_that_does_not_exist_is_retried_not_dead_lettered(store: ClickHouseStore) -> None:
    job = f"missing-{uuid.uuid4().hex[:6]}"
    store.command("RENAME TABLE decisions TO decisions_away")
    try:
        with pytest.raises(StoreError) as err:
            _write(store, [_decision(job, 0, now_ms(), [0])])
        assert err.value.retryable
    finally:
        store.command("RENAME TABLE decisions_away TO decisions")
    store.reset()  # what the sink does after a failure: the next insert rereads the columns
    out, published = _write(store, [_decision(job, 0, now_ms(), [0])])
    assert out.rows == {"decisions": 1} and published == []
