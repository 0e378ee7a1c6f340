"""The worker's progress-based liveness (/healthz) for the agents and for the sink: pure logic.

:class:`~trainguard.streams.metrics.WorkerMetrics` and :class:`~trainguard.streams.metrics.SinkMetrics` decide from
plain values -- the lags, counts and errors the Faust consumer and the sink report to them -- so
they are fed those values directly; nothing stands in for Kafka or ClickHouse (a ``StoreError`` is
only the error value the sink hands over), and only the clock is patched.  The real worker's
``/healthz`` against the real stack is checked in ``test_worker.py``, ``test_bad_records_live.py``
and ``test_failover.py`` (ClickHouse stopped: the retrying sink keeps the worker healthy).
"""

from __future__ import annotations

import pytest

import trainguard.streams.metrics as metrics_module
from trainguard.infra.clickhouse.store import StoreError
from trainguard.streams.metrics import SINK, SinkMetrics, WorkerMetrics

STALL_S = 60.0


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1_000_000.0]
    monkeypatch.setattr(metrics_module.time, "time", lambda: now[0])
    return now


def test_an_agent_is_stalled_only_while_the_agents_input_waits(clock: list[float]) -> None:
    m = WorkerMetrics()
    started = clock[0]
    m.processed("training")
    clock[0] += STALL_S + 1
    assert m.stalled_agents(STALL_S, started) == []  # nothing waiting: idle, not stalled
    m.set_lag("trainguard.training.steps", 5)
    assert m.stalled_agents(STALL_S, started) == ["training"]
    m.processed("training")
    assert m.stalled_agents(STALL_S, started) == []


def test_the_sink_is_judged_on_its_own_lag_not_the_agents(clock: list[float]) -> None:
    m = WorkerMetrics()
    observer = SinkMetrics(m)
    started = clock[0]
    observer.on_stored({"training_steps": 3}, 3, 0.01)
    m.processed("decide")
    clock[0] += STALL_S + 1
    m.set_lag("trainguard.control.detections", 4)  # the agents' input waits ...
    assert m.stalled_agents(STALL_S, started, sink=True) == ["decide"]  # ... not the sink's
    observer.on_lag({"trainguard.training.steps": 0}, buffered=7)  # read, not stored
    assert m.stalled_agents(STALL_S, started, sink=True) == ["decide", SINK]
    m.set_lag("trainguard.control.detections", 0)
    assert m.stalled_agents(STALL_S, started, sink=True) == [SINK]
    assert m.stalled_agents(STALL_S, started, sink=False) == []  # a worker without a sink


def test_a_sink_retrying_clickhouse_is_waiting_not_stalled(clock: list[float]) -> None:
    m = WorkerMetrics()
    observer = SinkMetrics(m)
    started = clock[0]
    observer.on_lag({"trainguard.training.steps": 400}, buffered=0)
    for _ in range(10):  # ClickHouse is down for far longer than the stall threshold
        clock[0] += STALL_S / 4
        observer.on_failure(StoreError("connection refused"))
    assert m.stalled_agents(STALL_S, started, sink=True) == []
    clock[0] += STALL_S + 1  # the loop stopped going round (no insert tried, none stored)
    assert m.stalled_agents(STALL_S, started, sink=True) == [SINK]


def test_a_sink_hung_from_the_start_is_stalled(clock: list[float]) -> None:
    m = WorkerMetrics()
    started = clock[0]
    SinkMetrics(m).on_lag({"trainguard.telemetry.gpu": 12}, buffered=0)
    assert m.stalled_agents(STALL_S, started, sink=True) == []  # within the grace period
    clock[0] += STALL_S + 1
    assert m.stalled_agents(STALL_S, started, sink=True) == [SINK]


def test_sink_metrics_reach_prometheus(clock: list[float]) -> None:
    from prometheus_client import generate_latest

    m = WorkerMetrics()
    observer = SinkMetrics(m)
    observer.on_stored({"gpu_samples": 8, "log_lines": 1}, 9, 0.02)
    observer.on_failure(StoreError("down"))
    observer.on_dead_letters(2)
    observer.on_lag({"trainguard.telemetry.gpu": 3}, buffered=1)
    observer.on_lag({}, buffered=0)  # the partitions went to another worker's sink
    text = generate_latest(m.registry).decode()
    assert 'trainguard_sink_rows_total{table="gpu_samples"} 8.0' in text
    assert "trainguard_sink_failures_total 1.0" in text
    assert 'trainguard_dead_letters_total{agent="sink"} 2.0' in text
    assert 'trainguard_agent_events_total{agent="sink"} 9.0' in text
    assert 'trainguard_sink_lag{topic="trainguard.telemetry.gpu"} 0.0' in text
    assert "trainguard_sink_batch_seconds_count 1.0" in text
    assert m.total_sink_lag() == 0
