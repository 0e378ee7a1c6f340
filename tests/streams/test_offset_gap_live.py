"""Records the consumer skipped, read directly, on the real broker.

- An agent's guard given a record past its partition's expected offset reads the records in
  between from the broker and hands them to the agent first, in order (the gaps it exists for --
  records Faust skipped around a rebalance -- cannot be made on demand; here the record is real
  and the guard is the worker's, only the delivery is the test's).
- A real gap that holds no record (the commit marker of another producer's transaction) is read
  as empty by a real worker and passed: the record after it is handled, the partition never stalls.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.net import free_ports
from tests.streams.harness import Watcher, WorkerProcess, unique
from trainguard.infra.config import Settings
from trainguard.schemas.base import now_ms
from trainguard.schemas.codec import encode
from trainguard.schemas.control import Decision
from trainguard.schemas.topics import DECISIONS, topic_for
from trainguard.schemas.workload import LogLine

pytestmark = pytest.mark.slow
XID_79 = "[ 8123.456789] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."


def _counter(metrics: str, name: str) -> float:
    found = re.findall(rf'^{name}{{agent="inspection"}} ([0-9.e+]+)$', metrics, re.M)
    return float(found[0]) if found else 0.0


# A cold worker (start and first consumption allowed 150 s) and two decisions (60 s each).
@pytest.mark.timeout(420)
def test_a_transaction_marker_is_read_as_an_empty_gap_and_passed(
    stack_settings: Settings, tmp_path: Path
) -> None:
    from kafka import KafkaProducer

    app_id, job = unique("tg-gap"), unique("gap")
    (port,) = free_ports(1)
    worker = WorkerProcess(app_id, port, tmp_path / "w.log", None, stack_settings).start()
    watcher = Watcher(stack_settings, DECISIONS)
    kafka = stack_settings.kafka.client_kwargs()
    before, after = (
        LogLine(node=f"{job}-n{i}", ts_ms=now_ms(), source="kernel", line=XID_79, seq=i, job=job)
        for i in (0, 1)
    )
    topic = topic_for(before)
    try:
        tx = KafkaProducer(**kafka, transactional_id=unique("tg-gap-tx"), acks="all", enable_idempotence=True)
        try:
            tx.init_transactions()
            tx.begin_transaction()
            first = tx.send(topic.name, key=topic.key_of(before), value=encode(before)).get(30)
            tx.commit_transaction()  # its marker takes the partition's next offset
        finally:
            tx.close()
        plain = KafkaProducer(**kafka, acks="all")
        try:
            second = plain.send(
                topic.name, key=topic.key_of(after), value=encode(after), partition=first.partition
            ).get(30)
        finally:
            plain.close()
        assert second.offset >= first.offset + 2, (first, second)  # the marker lies between them

        for line in (before, after):

            def decided(e: object, node: str = line.node) -> bool:
                return isinstance(e, Decision) and e.job == job and node in e.targets.machines

            watcher.wait_for(decided, 60)
        metrics = worker.metrics()
        assert _counter(metrics, "trainguard_input_gaps_total") == 1, metrics[-2000:]
        assert _counter(metrics, "trainguard_input_gap_records_total") == 0  # the marker: no record
        assert _counter(metrics, "trainguard_input_gap_unread_total") == 0
        assert worker.healthz() is not None
    finally:
        watcher.close()
        worker.stop()


def test_skipped_records_are_read_directly_and_handled_first_in_order(stack_settings: Settings) -> None:
    import asyncio

    from aiokafka import AIOKafkaConsumer, TopicPartition
    from kafka import KafkaProducer

    from trainguard.schemas.base import Event
    from trainguard.streams.config import WorkerConfig
    from trainguard.streams.context import WorkerContext
    from trainguard.streams.kafka_compat import aiokafka_kwargs

    job = unique("gapfill")
    lines = [
        LogLine(node=f"{job}-n", ts_ms=now_ms(), source="kernel", line=f"line {i}", seq=i, job=job)
        for i in range(8)
    ]
    topic = topic_for(lines[0])
    producer = KafkaProducer(**stack_settings.kafka.client_kwargs(), acks="all")
    try:  # one node: one key, one partition, consecutive offsets
        sent = [producer.send(topic.name, key=topic.key_of(ln), value=encode(ln)).get(30) for ln in lines]
    finally:
        producer.close()
    partition, first = sent[0].partition, sent[0].offset

    async def run() -> tuple[list[int], float]:
        ctx = WorkerContext(settings=stack_settings, cfg=WorkerConfig(app_id=unique("tg-gapfill")), app=None)
        ctx.offsets.start(topic.name, partition, first)  # as for a partition new to the worker
        reader = AIOKafkaConsumer(**aiokafka_kwargs(stack_settings.kafka), group_id=None)
        await reader.start()
        try:
            tp = TopicPartition(topic.name, partition)
            reader.assign([tp])
            reader.seek(tp, sent[5].offset)
            later: list[Any] = []
            while len(later) < 3:
                later += (await reader.getmany(tp, timeout_ms=10_000)).get(tp, [])
        finally:
            await reader.stop()
        handled: list[int] = []

        async def body(ev: Event) -> None:
            assert isinstance(ev, LogLine)
            handled.append(ev.seq)

        # The consumer delivers the sixth record without the five before it, then the two after.
        for rec in later[:3]:

            class Delivered:
                message, key, value = rec, rec.key, rec.value

            await ctx.guard(Delivered(), "inspection", body)
        gaps = ctx.metrics.input_gaps.labels("inspection")._value.get()
        return handled, gaps

    handled, gaps = asyncio.run(run())
    # Each record once, in order: the records after a filled gap are no gap of their own.
    assert handled == [0, 1, 2, 3, 4, 5, 6, 7] and gaps == 1
