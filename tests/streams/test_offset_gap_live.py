"""The worker's seek back over skipped input records, on the live consumer: a real gap in a
partition (the commit marker of another producer's transaction takes an offset that never
delivers a record) is sought back over, found real, and passed -- the record after it is handled,
the partition never stalls.  (The gaps the guard exists for -- records Faust skipped around a
rebalance -- cannot be made on demand; :mod:`trainguard.streams.offsets` and its unit tests.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.net import free_ports
from tests.streams.harness import Watcher, WorkerProcess, unique
from tests.waiting import wait_until
from trainguard.infra.config import Settings
from trainguard.schemas.base import now_ms
from trainguard.schemas.codec import encode
from trainguard.schemas.control import Decision
from trainguard.schemas.topics import DECISIONS, topic_for
from trainguard.schemas.workload import LogLine

pytestmark = pytest.mark.slow
XID_79 = "[ 8123.456789] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."


def _rewinds(metrics: str, name: str) -> float:
    found = re.findall(rf'^{name}{{agent="inspection"}} ([0-9.e+]+)$', metrics, re.M)
    return float(found[0]) if found else 0.0


# A cold worker (start and first consumption allowed 150 s) and two decisions (60 s each).
@pytest.mark.timeout(420)
def test_a_transaction_marker_is_sought_back_over_and_passed(
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
        assert _rewinds(metrics, "trainguard_input_rewinds_total") >= 1, metrics[-2000:]
        assert _rewinds(metrics, "trainguard_input_gaps_accepted_total") == 1
        wait_until(lambda: "are not in the log" in worker.log_tail(20_000), 10, "the accepted gap logged")
        assert worker.healthz() is not None
    finally:
        watcher.close()
        worker.stop()
