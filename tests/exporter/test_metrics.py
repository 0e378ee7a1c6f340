"""The node exporter's Prometheus metrics, counted where things happen: a source's round (the
runner), the spool filling and dropping (delivery), the reporter refusing or overflowing; served
on ``/metrics`` while the service runs, and never in the way of the exporter itself."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.exporter.conftest import make_cfg
from tests.net import free_port
from tests.waiting import wait_until
from trainguard.commands.exporter import exporter
from trainguard.infra.config import KafkaConfig, Settings
from trainguard.schemas.codec import encode
from trainguard.schemas.telemetry import Heartbeat
from trainguard.schemas.workload import TrainingStep
from trainguard.streams.exporter.config import load_exporter_config
from trainguard.streams.exporter.delivery import Delivery
from trainguard.streams.exporter.metrics import ERROR_TEXT_MAX, ExporterMetrics
from trainguard.streams.exporter.runner import Exporter
from trainguard.streams.exporter.service import ExporterService
from trainguard.streams.exporter.spool import Spool

ONLY_HOST_AND_NIC = {
    "process": {"enabled": False},
    "reporter": {"enabled": False},
    "kernel_log": {"enabled": False},
    "heartbeat": {"enabled": False},
}


def value(m: ExporterMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def error_series(m: ExporterMetrics, source: str) -> list[str]:
    """The ``error`` labels of the source's last-error info series."""
    return [
        s.labels["error"]
        for family in m.registry.collect()
        if family.name == "trainguard_exporter_source_last_error_info"
        for s in family.samples
        if s.labels["source"] == source
    ]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_each_round_counts_its_outcome_duration_and_time(root: Path, tmp_path: Path) -> None:
    net, hidden = root / "sys/class/net", root / "sys/class/net-away"
    net.rename(hidden)  # the nic source fails every round until it is back
    cfg = make_cfg(root, tmp_path / "state", **ONLY_HOST_AND_NIC)
    m = ExporterMetrics()
    runner = Exporter(cfg, lambda ev: None, metrics=m)
    try:
        # Before any round: the series exist, at zero (an alert sees a source that never succeeds).
        assert value(m, "trainguard_exporter_collections_total", source="nic", outcome="ok") == 0
        assert value(m, "trainguard_exporter_source_last_success_timestamp_seconds", source="nic") == 0
        assert value(m, "trainguard_exporter_source_interval_seconds", source="nic") == 30.0
        t0 = time.time()
        runner.run_once()
        assert value(m, "trainguard_exporter_collections_total", source="host", outcome="ok") == 1
        assert value(m, "trainguard_exporter_source_up", source="host") == 1
        assert value(m, "trainguard_exporter_source_last_success_timestamp_seconds", source="host") >= t0
        assert value(m, "trainguard_exporter_collection_seconds_count", source="host") == 1
        assert value(m, "trainguard_exporter_collections_total", source="nic", outcome="error") == 1
        assert value(m, "trainguard_exporter_collections_total", source="nic", outcome="ok") == 0
        assert value(m, "trainguard_exporter_source_up", source="nic") == 0
        assert value(m, "trainguard_exporter_source_last_error_timestamp_seconds", source="nic") >= t0
        assert value(m, "trainguard_exporter_collection_seconds_count", source="nic") == 1  # failed too
        (first,) = error_series(m, "nic")
        assert first.startswith("FileNotFoundError: ") and "sys/class/net" in first

        hidden.rename(net)
        runner.run_source("nic")
        assert value(m, "trainguard_exporter_collections_total", source="nic", outcome="ok") == 1
        assert value(m, "trainguard_exporter_source_up", source="nic") == 1
        assert error_series(m, "nic") == [first]  # the last error stays, with its time

        runner.set_interval("nic", 2.5)
        assert value(m, "trainguard_exporter_source_interval_seconds", source="nic") == 2.5
    finally:
        runner.stop()


def test_a_new_error_replaces_the_last_ones_series_cut_short(root: Path, tmp_path: Path) -> None:
    cfg = make_cfg(root, tmp_path / "state", **ONLY_HOST_AND_NIC)
    m = ExporterMetrics()
    runner = Exporter(cfg, lambda ev: None, metrics=m)
    errors = iter([OSError("first"), ValueError("x" * 1000), ValueError("x" * 1000)])

    def failing() -> list:
        raise next(errors)

    runner.sources["host"].collect = failing  # type: ignore[method-assign]
    try:
        runner.run_source("host")
        assert error_series(m, "host") == ["OSError: first"]
        runner.run_source("host")
        runner.run_source("host")
        (text,) = error_series(m, "host")  # one series per source, whatever its errors said
        assert text.startswith("ValueError: xxx") and len(text) == ERROR_TEXT_MAX
        assert value(m, "trainguard_exporter_collections_total", source="host", outcome="error") == 3
    finally:
        runner.stop()


def test_spool_depth_appends_and_drops_under_the_bound(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", max_bytes=4096, segment_bytes=1024, fsync_interval_s=None)
    m = ExporterMetrics()
    delivery = Delivery(KafkaConfig(), spool, metrics=m)  # never started: nothing leaves the spool
    for i in range(200):
        delivery.publish(Heartbeat(node="n1", component="exporter", ts_ms=1_000 + i, seq=i))
    assert value(m, "trainguard_exporter_records_spooled_total") == 200
    assert spool.dropped_records > 0
    assert value(m, "trainguard_exporter_records_dropped_total", reason="spool_full") == spool.dropped_records
    assert (
        value(m, "trainguard_exporter_spool_records") == spool.pending_records == 200 - spool.dropped_records
    )
    assert value(m, "trainguard_exporter_spool_bytes") == spool.pending_bytes
    assert 0 < spool.pending_bytes <= 4096 + 1024
    assert value(m, "trainguard_exporter_kafka_connected") == 0
    assert value(m, "trainguard_exporter_records_dropped_total", reason="reporter_uid") == 0
    spool.close()


def test_reporter_refusals_and_overflow_are_counted_as_drops(root: Path, tmp_path: Path) -> None:
    cfg = make_cfg(
        root,
        tmp_path / "state",
        **{**ONLY_HOST_AND_NIC, "reporter": {"enabled": True, "max_per_round": 2}},
        host={"enabled": False},
        nic={"enabled": False},
    )
    m = ExporterMetrics()
    published: list = []
    runner = Exporter(cfg, published.append, metrics=m)
    try:
        runner.run_once()  # binds the socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.sendto(b"\xff\x00 not json", cfg.reporter.socket)

        def refused() -> bool:
            runner.run_once()  # refusals are counted when a round decodes the datagram
            return value(m, "trainguard_exporter_records_dropped_total", reason="reporter_invalid") == 1

        wait_until(refused, 10, "the garbage datagram counted as a drop", interval_s=0.05)
        for step in range(4):  # two fit the queue, two overflow it (counted as the receiver reads)
            s.sendto(
                encode(TrainingStep(job="job-t", rank=0, step=step, ts_ms=1_000 + step)), cfg.reporter.socket
            )
        s.close()
        wait_until(
            lambda: value(m, "trainguard_exporter_records_dropped_total", reason="reporter_queue_full") == 2,
            10,
            lambda: f"two overflows counted; the source counted {runner.sources['reporter'].overflow}",  # type: ignore[attr-defined]
            interval_s=0.05,
        )
        runner.run_once()
        assert sorted(e.step for e in published if isinstance(e, TrainingStep)) == [0, 1]
    finally:
        runner.stop()


@pytest.mark.slow
def test_the_service_serves_metrics_while_it_runs(
    stack_settings: Settings, root: Path, tmp_path: Path
) -> None:
    port = free_port()
    cfg = make_cfg(
        root,
        tmp_path / "state",
        node=f"m-{uuid.uuid4().hex[:8]}",
        heartbeat={"interval_s": 0.5},
        commands={"enabled": False},
        metrics={"host": "127.0.0.1", "port": port},
    )
    service = ExporterService(cfg, stack_settings.kafka)
    service.start()
    try:
        assert service.metrics_port == port

        def delivered() -> str | None:
            text = scrape(port)
            ok = (
                'trainguard_exporter_records_published_total{topic="trainguard.telemetry.heartbeats"}' in text
            )
            return text if ok and "trainguard_exporter_kafka_connected 1.0" in text else None

        text = wait_until(delivered, 60, "heartbeats acknowledged by Kafka, on /metrics")
        assert 'trainguard_exporter_collections_total{outcome="ok",source="host"}' in text
        assert 'trainguard_exporter_source_last_success_timestamp_seconds{source="heartbeat"}' in text
        assert (
            "trainguard_exporter_spool_records " in text
            and "trainguard_exporter_records_spooled_total" in text
        )
        published = service.metrics.registry.get_sample_value(
            "trainguard_exporter_records_published_total", {"topic": "trainguard.telemetry.heartbeats"}
        )
        assert published is not None and 1 <= published <= service.delivery.delivered
    finally:
        service.stop()
    with pytest.raises(urllib.error.URLError):
        scrape(port)  # the port is free again


@pytest.mark.slow
def test_port_zero_serves_nothing_and_a_taken_port_is_only_logged(
    stack_settings: Settings, root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(Exception, match="bogus"):
        make_cfg(root, tmp_path / "s0", metrics={"bogus": 1})
    assert load_exporter_config({}, environ={}).metrics.port == 9401
    off_cfg = make_cfg(root, tmp_path / "s1", commands={"enabled": False}, metrics={"port": 0})
    off = ExporterService(off_cfg, stack_settings.kafka)
    with contextlib.closing(socket.socket()) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = make_cfg(
            root, tmp_path / "s2", commands={"enabled": False}, metrics={"host": "127.0.0.1", "port": port}
        )
        busy = ExporterService(cfg, stack_settings.kafka)
        try:
            off.start()
            assert off.metrics_port is None
            with caplog.at_level(logging.WARNING, logger="trainguard.infra.metrics_server"):
                busy.start()
            assert busy.metrics_port is None
            assert f"cannot serve /metrics on 127.0.0.1:{port}" in caplog.text
            # The exporter runs on regardless: its sources still collect.
            wait_until(
                lambda: busy.metrics.registry.get_sample_value(
                    "trainguard_exporter_collections_total", {"source": "host", "outcome": "ok"}
                ),
                30,
                "a host round",
            )
        finally:
            off.stop()
            busy.stop()


def test_the_metrics_port_flag_is_checked() -> None:
    res = CliRunner().invoke(exporter, ["--metrics-port", "70000", "--once", "--print"], obj={})
    assert res.exit_code == 2 and "--metrics-port" in res.output
