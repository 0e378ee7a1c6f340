"""The Kafka -> ClickHouse sink keeps every row through a ClickHouse outage."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from infra.bus import EventProducer
from infra.clickhouse.store import ClickHouseStore
from infra.config import Settings
from infra.sink import Sink, SinkConfig
from infra.stack.clickhouse import ClickHouseServer
from schemas.base import now_ms
from schemas.topics import STEPS
from schemas.workload import TrainingStep

pytestmark = pytest.mark.slow


def test_clickhouse_down_loses_no_row(stack_settings: Settings, tmp_path: Path) -> None:
    # A private ClickHouse we can stop without disturbing other tests; the shared Kafka broker.
    stack_cfg = replace(
        stack_settings.stack, home=str(tmp_path), clickhouse_http_port=29423, clickhouse_tcp_port=29424
    )
    server = ClickHouseServer(stack_cfg)
    server.start()
    server.wait_healthy(30)
    settings = replace(stack_settings, clickhouse=replace(stack_settings.clickhouse, port=29423))
    store = ClickHouseStore(settings.clickhouse)
    store.migrate()
    job = f"outage-{uuid.uuid4().hex[:8]}"
    sink = Sink(
        settings,
        SinkConfig(group_id=f"sink-{job}", max_wait_s=0.2, retry_backoff_s=0.2, retry_backoff_max_s=1.0),
        topics=[STEPS.name],
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
        assert sink.stats.failed_inserts > 0
        server.start()
        server.wait_healthy(30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and store.count("training_steps", "job = %(j)s", {"j": job}) < 300:
            time.sleep(0.5)
        assert store.count("training_steps", "job = %(j)s", {"j": job}) == 300
        assert runner.is_alive()  # the worker survived the outage
    finally:
        stop.set()
        runner.join(30)
        sink.close()
        server.stop()
