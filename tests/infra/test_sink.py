"""The Kafka -> ClickHouse sink keeps every row through a ClickHouse outage."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import pytest

from infra.bus import EventProducer
from infra.clickhouse.store import ClickHouseStore
from infra.config import Settings
from infra.sink import Sink, SinkConfig, SinkThread
from infra.stack.clickhouse import ClickHouseServer
from schemas.base import now_ms
from schemas.topics import STEPS
from schemas.workload import TrainingStep
from tests.net import free_ports
from tests.waiting import wait_until

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
        producer = EventProducer(settings.kafka)
        t0 = now_ms()
        for i in range(300):
            producer.send(TrainingStep(job=job, rank=i % 4, step=i // 4, ts_ms=t0 + i, loss=1.0))
        producer.flush()
        producer.close()
        time.sleep(3)  # the sink keeps failing, backing off and rewinding meanwhile
        assert sink.stats.failed_inserts > 0 and len(seen.failures) == sink.stats.failed_inserts
        server.start()
        server.wait_healthy(30)
        wait_until(
            lambda: store.count("training_steps", "job = %(j)s", {"j": job}) >= 300,
            60,
            f"the 300 steps of job {job} in ClickHouse once it is back",
        )
        assert store.count("training_steps", "job = %(j)s", {"j": job}) == 300
        assert runner.is_alive()  # the worker survived the outage
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
    producer = EventProducer(settings.kafka)
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


def _wait_for_committed_offsets(settings: Settings, group: str, timeout_s: float = 60.0) -> None:
    """Until ``group`` has an offset committed for every partition of the steps topic."""
    from kafka import KafkaConsumer, TopicPartition

    probe = KafkaConsumer(**settings.kafka.client_kwargs(), group_id=group, enable_auto_commit=False)
    try:
        parts = [TopicPartition(STEPS.name, p) for p in range(STEPS.partitions)]
        wait_until(
            lambda: all(probe.committed(tp) is not None for tp in parts),
            timeout_s,
            f"group {group} to commit an offset on every partition of {STEPS.name}",
            interval_s=0.5,
        )
    finally:
        probe.close()
