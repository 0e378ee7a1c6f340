"""The Kafka -> ClickHouse sink keeps every row through a ClickHouse outage, and a poisoned event
never stalls it: the rest of its batch is stored, the poison dead-lettered, the offsets committed."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.net import free_ports
from tests.waiting import wait_until
from trainguard.infra.bus import EventProducer, signer_for
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.config import Settings
from trainguard.infra.sink import BatchWriter, Sink, SinkConfig, SinkThread, Written
from trainguard.infra.stack.clickhouse import ClickHouseServer
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.codec import DecodeError, decode, encode
from trainguard.schemas.control import DeadLetter, Decision, Targets
from trainguard.schemas.enums import Action
from trainguard.schemas.topics import DEAD_LETTERS, DECISIONS, STEPS, Topic
from trainguard.schemas.workload import TrainingStep

pytestmark = pytest.mark.slow


class Recorder:
    """A sink observer that keeps what it hears (the worker's metrics implement the same hooks)."""

    def __init__(self) -> None:
        self.stored: list[tuple[dict[str, int], int]] = []
        self.failures: list[Exception] = []
        self.dead_letters = 0
        self.lags: list[tuple[dict[str, int], int]] = []

    def on_stored(self, rows: Mapping[str, int], events: int, seconds: float) -> None:
        self.stored.append((dict(rows), events))

    def on_failure(self, error: Exception) -> None:
        self.failures.append(error)

    def on_dead_letters(self, n: int) -> None:
        self.dead_letters += n

    def on_lag(self, lag: Mapping[str, int], buffered: int) -> None:
        self.lags.append((dict(lag), buffered))


def test_clickhouse_down_loses_no_row(stack_settings: Settings, tmp_path: Path) -> None:
    # A private ClickHouse we can stop without disturbing other tests; the shared Kafka broker.
    http_port, tcp_port = free_ports(2)
    stack_cfg = replace(
        stack_settings.stack, home=str(tmp_path), clickhouse_http_port=http_port, clickhouse_tcp_port=tcp_port
    )
    server = ClickHouseServer(stack_cfg)
    server.start()
    server.wait_healthy(30)
    settings = replace(stack_settings, clickhouse=replace(stack_settings.clickhouse, port=http_port))
    store = ClickHouseStore(settings.clickhouse)
    store.migrate()
    job = f"outage-{uuid.uuid4().hex[:8]}"
    seen = Recorder()
    sink = Sink(
        settings,
        SinkConfig(group_id=f"sink-{job}", max_wait_s=0.2, retry_backoff_s=0.2, retry_backoff_max_s=1.0),
        topics=[STEPS.name],
        observer=seen,
    )
    stop = threading.Event()
    runner = threading.Thread(target=sink.run, args=(stop.is_set,), daemon=True)
    try:
        server.stop()
        runner.start()
        producer = EventProducer(settings.kafka, signer=signer_for(settings, "operator"))
        t0 = now_ms()
        for i in range(300):
            producer.send(TrainingStep(job=job, rank=i % 4, step=i // 4, ts_ms=t0 + i, loss=1.0))
        producer.flush()
        producer.close()
        time.sleep(3)  # the sink keeps failing, backing off and rewinding meanwhile
        assert sink.stats.failed_inserts > 0 and len(seen.failures) == sink.stats.failed_inserts
        assert sink.stats.errors == 0  # an outage is expected, not an unexpected error
        # Nothing acked while down: the new group has committed at most where it started.
        start = _beginning_offsets(settings, [STEPS])
        assert all(off <= start[tp] for tp, off in _committed(settings, f"sink-{job}", [STEPS]).items())
        server.start()
        server.wait_healthy(30)
        wait_until(
            lambda: store.count("training_steps", "job = %(j)s", {"j": job}) >= 300,
            60,
            f"the 300 steps of job {job} in ClickHouse once it is back",
        )
        assert store.count("training_steps", "job = %(j)s", {"j": job}) == 300
        assert runner.is_alive()  # the worker survived the outage
        # The rows are visible in ClickHouse a moment before the sink thread counts its batch.
        wait_until(lambda: sink.stats.rows.get("training_steps", 0) >= 300, 10, "the sink to count its rows")
        assert (
            sum(rows.get("training_steps", 0) for rows, _ in seen.stored) == sink.stats.rows["training_steps"]
        )
        assert seen.lags and all(set(lag) <= {STEPS.name} for lag, _ in seen.lags)
    finally:
        stop.set()
        runner.join(30)
        sink.close()
        server.stop()


def test_a_new_group_starting_at_the_end_keeps_its_start_through_an_outage(
    stack_settings: Settings, tmp_path: Path
) -> None:
    # A worker's sink group starts at the end of the topics ("latest").  ClickHouse failing before
    # its first batch must rewind it to where it started, not to the beginning of the topic.
    http_port, tcp_port = free_ports(2)
    stack_cfg = replace(
        stack_settings.stack, home=str(tmp_path), clickhouse_http_port=http_port, clickhouse_tcp_port=tcp_port
    )
    server = ClickHouseServer(stack_cfg)
    server.start()
    server.wait_healthy(30)
    settings = replace(stack_settings, clickhouse=replace(stack_settings.clickhouse, port=http_port))
    store = ClickHouseStore(settings.clickhouse)
    store.migrate()
    job = f"latest-{uuid.uuid4().hex[:8]}"
    producer = EventProducer(settings.kafka, signer=signer_for(settings, "operator"))
    t0 = now_ms()
    for i in range(20):  # history the new group must not store
        producer.send(TrainingStep(job=f"{job}-old", rank=0, step=i, ts_ms=t0 + i, loss=1.0))
    producer.flush()
    cfg = SinkConfig(group_id=f"sink-{job}", max_wait_s=0.2, retry_backoff_s=0.2, retry_backoff_max_s=1.0)
    runner = SinkThread(settings, cfg, auto_offset_reset="latest", topics=[STEPS.name])
    try:
        runner.start()
        _wait_for_committed_offsets(settings, cfg.group_id)  # joined, at the end, that start committed
        server.stop()
        for i in range(50):
            producer.send(TrainingStep(job=job, rank=i % 2, step=i // 2, ts_ms=t0 + 100 + i, loss=1.0))
        producer.flush()
        time.sleep(3)  # inserts fail, the sink rewinds and retries
        server.start()
        server.wait_healthy(30)
        wait_until(
            lambda: store.count("training_steps", "job = %(j)s", {"j": job}) >= 50,
            60,
            f"the 50 steps of job {job} in ClickHouse once it is back",
        )
        assert store.count("training_steps", "job = %(j)s", {"j": job}) == 50
        assert store.count("training_steps", "job = %(j)s", {"j": f"{job}-old"}) == 0
        assert runner.is_alive() and runner.restarts == 0
    finally:
        producer.close()
        runner.stop()
        server.stop()


class _Buggy(BatchWriter):
    """A writer that fails every batch with an error nobody expects (a bug) until it is fixed."""

    def __init__(self, inner: BatchWriter) -> None:
        super().__init__(inner.store, inner.publish)
        self.fixed = False

    def write(self, items: Sequence[tuple[Any, Event]]) -> Written:
        if not self.fixed:
            raise RuntimeError("a bug in the sink")
        return super().write(items)


def test_an_unexpected_error_is_retried_and_never_acks(stack_settings: Settings) -> None:
    settings = stack_settings
    job = f"bug-{uuid.uuid4().hex[:8]}"
    cfg = SinkConfig(group_id=f"sink-{job}", max_wait_s=0.2, retry_backoff_s=0.2, retry_backoff_max_s=0.5)
    seen = Recorder()
    sink = Sink(settings, cfg, topics=[STEPS.name], observer=seen, auto_offset_reset="latest")
    sink.writer = buggy = _Buggy(sink.writer)
    store = ClickHouseStore(settings.clickhouse)
    stop = threading.Event()
    runner = threading.Thread(target=sink.run, args=(stop.is_set,), daemon=True)
    producer = EventProducer(settings.kafka, signer=signer_for(settings, "operator"))
    try:
        runner.start()
        _wait_for_committed_offsets(settings, cfg.group_id)
        before = _committed(settings, cfg.group_id, [STEPS])
        t0 = now_ms()
        for i in range(20):
            producer.send(TrainingStep(job=job, rank=0, step=i, ts_ms=t0 + i))
        producer.flush()
        wait_until(lambda: sink.stats.errors >= 3, 30, "three failed attempts")
        assert _committed(settings, cfg.group_id, [STEPS]) == before  # not acked meanwhile
        buggy.fixed = True
        wait_until(
            lambda: store.count("training_steps", "job = %(j)s", {"j": job}) >= 20,
            60,
            f"the 20 steps of job {job} once the error is gone",
        )
        assert store.count("training_steps", "job = %(j)s", {"j": job}) == 20
        assert runner.is_alive() and sink.stats.errors >= 3
        assert {str(e) for e in seen.failures} == {"a bug in the sink"}
    finally:
        stop.set()
        runner.join(30)
        sink.close()
        producer.close()
        store.close()


def _stage(event: Event, table: str) -> str:
    """Where the pipeline refuses ``event``: the codec when its schema bounds it, else the sink."""
    try:
        decode(encode(event))
    except DecodeError:
        return "decode"
    return f"sink:{table}"


def test_a_poisoned_batch_stores_the_rest_dead_letters_the_poison_and_commits(
    stack_settings: Settings,
) -> None:
    settings = stack_settings
    job = f"poison-{uuid.uuid4().hex[:8]}"
    t0 = now_ms()
    cfg = SinkConfig(group_id=f"sink-{job}", max_wait_s=0.5, retry_backoff_s=0.2, retry_backoff_max_s=1.0)
    seen = Recorder()
    sink = Sink(settings, cfg, topics=[STEPS.name, DECISIONS.name], observer=seen, auto_offset_reset="latest")
    stop = threading.Event()
    runner = threading.Thread(target=sink.run, args=(stop.is_set,), daemon=True)
    store = ClickHouseStore(settings.clickhouse)
    producer = EventProducer(settings.kafka, signer=signer_for(settings, "operator"))
    dlq_start = _end_offsets(settings, [DEAD_LETTERS])
    try:
        runner.start()
        _wait_for_committed_offsets(settings, cfg.group_id, [STEPS, DECISIONS])  # joined, at the end
        # A rank past Array(Int32), and a ts_ms whose DateTime the row mapper cannot make: the
        # codec refuses them when the schema bounds them, else ClickHouse and the mapper do.
        poison_range = Decision(
            decision_id=f"{job}-bad",
            ts_ms=t0,
            job=job,
            action=Action.RESTART,
            targets=Targets(machines=["m1"], ranks=[2**40]),
        )
        poison_mapping = TrainingStep(job=job, rank=1, step=0, ts_ms=2**62, loss=1.0)
        events: list[Event] = [
            TrainingStep(job=job, rank=0, step=i, ts_ms=t0 + i, loss=1.0) for i in range(30)
        ]
        events[10:10] = [poison_range, poison_mapping]
        events += [
            Decision(decision_id=f"{job}-ok{i}", ts_ms=t0, job=job, action=Action.EVICT) for i in range(3)
        ]
        sent = [producer.send(ev) for ev in events]
        producer.flush()
        meta = [f.get(timeout=30) for f in sent]
        poison_at = {
            (m.topic, m.partition, m.offset): ev
            for m, ev in zip(meta, events, strict=True)
            if ev in (poison_range, poison_mapping)
        }
        expected = {
            key: _stage(ev, "decisions" if ev is poison_range else "training_steps")
            for key, ev in poison_at.items()
        }
        # A forged (unsigned) decision: kept as evidence in dead_letters (stage auth), never stored
        # as a decision.
        forged = Decision(decision_id=f"{job}-forged", ts_ms=t0, job=job, action=Action.EVICT)
        m = EventProducer(settings.kafka).send(forged).get(timeout=30)
        expected[(m.topic, m.partition, m.offset)] = "auth"

        def dead_lettered() -> dict[tuple[str, int, int], str]:
            rows = store.query(
                "SELECT topic, partition, offset, stage FROM dead_letters FINAL "
                "WHERE key = %(j)s AND offset >= 0",
                {"j": job},
            )
            return {(t, int(p), int(o)): st for t, p, o, st in rows}

        wait_until(
            lambda: (
                store.count("training_steps", "job = %(j)s", {"j": job}) >= 30
                and store.count("decisions", "job = %(j)s", {"j": job}) >= 3
                and len(dead_lettered()) >= 3
            ),
            60,
            lambda: (
                f"30 steps, 3 decisions and 3 dead letters of job {job} (dead letters: {dead_lettered()})"
            ),
        )
        assert store.count("training_steps", "job = %(j)s", {"j": job}) == 30
        assert store.count("decisions", "job = %(j)s", {"j": job}) == 3
        assert dead_lettered() == expected
        sink_made = [k for k, stage in expected.items() if stage.startswith("sink:")]
        reasons = store.query(
            "SELECT reason FROM dead_letters FINAL WHERE key = %(j)s AND stage LIKE 'sink:%%'", {"j": job}
        )
        assert len(reasons) == len(sink_made) and all(r for (r,) in reasons)
        # Acknowledged: the group's offsets are past every record of the batch, poison included.
        last: dict[tuple[str, int], int] = {}
        for m in meta:
            last[(m.topic, m.partition)] = max(last.get((m.topic, m.partition), -1), m.offset)
        wait_until(
            lambda: all(
                _committed(settings, cfg.group_id, [STEPS, DECISIONS]).get(tp, -1) > off
                for tp, off in last.items()
            ),
            30,
            "the sink group to commit past every record it was sent",
        )
        # The sink's own dead letters are on the dead-letter topic too.
        on_topic = [
            d for d in _read_from(settings, dlq_start) if d.key == job and d.stage.startswith("sink:")
        ]
        assert {(d.topic, d.partition, d.offset) for d in on_topic} == set(sink_made)
        assert runner.is_alive() and sink.stats.errors == 0 and not seen.failures
        assert sink.stats.refused == len(sink_made) and seen.dead_letters == 3  # decode x1, auth x1, sink x1
    finally:
        stop.set()
        runner.join(30)
        sink.close()
        producer.close()
        store.close()


def _committed(settings: Settings, group: str, topics: list[Topic]) -> dict[tuple[str, int], int]:
    """The offsets ``group`` has committed, per (topic, partition) that has one."""
    from kafka import KafkaConsumer, TopicPartition

    probe = KafkaConsumer(**settings.kafka.client_kwargs(), group_id=group, enable_auto_commit=False)
    try:
        out = {}
        for t in topics:
            for p in range(t.partitions):
                off = probe.committed(TopicPartition(t.name, p))
                if off is not None:
                    out[(t.name, p)] = off
        return out
    finally:
        probe.close()


def _end_offsets(settings: Settings, topics: list[Topic], end: bool = True) -> dict[tuple[str, int], int]:
    from kafka import KafkaConsumer, TopicPartition

    probe = KafkaConsumer(**settings.kafka.client_kwargs(), enable_auto_commit=False)
    try:
        parts = [TopicPartition(t.name, p) for t in topics for p in range(t.partitions)]
        offsets = probe.end_offsets(parts) if end else probe.beginning_offsets(parts)
        return {(tp.topic, tp.partition): off for tp, off in offsets.items()}
    finally:
        probe.close()


def _beginning_offsets(settings: Settings, topics: list[Topic]) -> dict[tuple[str, int], int]:
    return _end_offsets(settings, topics, end=False)


def _read_from(settings: Settings, start: dict[tuple[str, int], int]) -> list[DeadLetter]:
    """The dead letters on the dead-letter topic from ``start`` to its current end."""
    from kafka import KafkaConsumer, TopicPartition

    probe = KafkaConsumer(**settings.kafka.client_kwargs(), enable_auto_commit=False)
    try:
        parts = {TopicPartition(t, p): off for (t, p), off in start.items()}
        probe.assign(list(parts))
        for tp, off in parts.items():
            probe.seek(tp, off)
        end = probe.end_offsets(list(parts))
        out: list[DeadLetter] = []
        deadline = time.monotonic() + 30
        while any(probe.position(tp) < end[tp] for tp in parts) and time.monotonic() < deadline:
            for recs in probe.poll(timeout_ms=500).values():
                for r in recs:
                    ev = decode(r.value)
                    if isinstance(ev, DeadLetter):
                        out.append(ev)
        return out
    finally:
        probe.close()


def _wait_for_committed_offsets(
    settings: Settings, group: str, topics: list[Topic] | None = None, timeout_s: float = 60.0
) -> None:
    """Until ``group`` has an offset committed for every partition of ``topics`` (the steps topic)."""
    topics = topics or [STEPS]
    n = sum(t.partitions for t in topics)
    wait_until(
        lambda: len(_committed(settings, group, topics)) == n,
        timeout_s,
        f"group {group} to commit an offset on every partition of {[t.name for t in topics]}",
        interval_s=0.5,
    )
