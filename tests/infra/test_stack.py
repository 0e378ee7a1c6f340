"""The embedded stack: restart durability, idempotent up, status, clear errors."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.net import free_ports
from tests.waiting import wait_until
from trainguard.cli import main
from trainguard.infra.config import Settings, StackConfig, load_settings
from trainguard.infra.stack.clickhouse import ClickHouseServer
from trainguard.infra.stack.kafka import KafkaServer
from trainguard.infra.stack.manager import Stack
from trainguard.infra.stack.procs import StackError

pytestmark = pytest.mark.slow


@pytest.fixture
def private_kafka(tmp_path: Path) -> Iterator[tuple[Settings, KafkaServer]]:
    """A second broker in its own home on other ports, so restarting it disturbs no other test."""
    port, controller_port = free_ports(2)
    env = {
        "TRAINGUARD_HOME": str(tmp_path),
        "TRAINGUARD__STACK__KAFKA_PORT": str(port),
        "TRAINGUARD__STACK__KAFKA_CONTROLLER_PORT": str(controller_port),
    }
    settings = load_settings(environ=env)
    server = KafkaServer(settings.stack)
    server.start()
    server.wait_healthy(90)
    yield settings, server
    server.stop()


# A private broker started twice (90 s each) and stopped twice (60 s each), read twice (30 s each):
# its own waits allow up to about 360 s, so they, not the 300 s default, say what was late.
@pytest.mark.timeout(600)
def test_broker_restart_keeps_topics_data_and_group_offsets(
    private_kafka: tuple[Settings, KafkaServer],
) -> None:
    from kafka import KafkaConsumer, KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    settings, server = private_kafka
    kw = settings.kafka.client_kwargs()
    admin = KafkaAdminClient(**kw)
    admin.create_topics([NewTopic("durable", 2, 1)])
    admin.close()
    producer = KafkaProducer(**kw, acks="all")
    for i in range(100):
        producer.send("durable", key=str(i % 7).encode(), value=f"m{i}".encode())
    producer.flush()
    producer.close()

    def consume(n: int) -> list[bytes]:
        c = KafkaConsumer(
            "durable",
            **kw,
            group_id="g",
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            max_poll_records=n,
            session_timeout_ms=6000,
            heartbeat_interval_ms=2000,
        )
        got: list[bytes] = []

        def have_n() -> bool:
            for recs in c.poll(timeout_ms=500, max_records=n - len(got)).values():
                got.extend(r.value for r in recs)
            return len(got) >= n

        try:
            wait_until(have_n, 30, lambda: f"{n} records of 'durable' (got {len(got)})", interval_s=0)
            c.commit()
        finally:
            c.close()
        return got

    first = consume(60)
    assert len(first) == 60
    assert server.stop()
    assert server.proc.pid() is None
    assert server.start()
    server.wait_healthy(90)
    rest = consume(40)
    assert len(rest) == 40
    assert sorted(first + rest, key=lambda v: int(v[1:])) == [f"m{i}".encode() for i in range(100)]


def test_up_is_idempotent_and_status_reports_both(stack_settings: Settings) -> None:
    report = Stack(stack_settings).up()
    assert report.started == [] and report.migrations_applied == [] and report.topics_created == []
    res = CliRunner().invoke(main, ["stack", "status", "--json"])
    assert res.exit_code == 0, res.output
    st = json.loads(res.output)
    assert st["healthy"] and st["kafka"]["healthy"] and st["clickhouse"]["healthy"]
    assert st["kafka"]["bootstrap_servers"] == stack_settings.kafka.bootstrap_servers
    assert st["clickhouse"]["database"] == "trainguard"


def test_status_exit_code_is_nonzero_when_nothing_runs(tmp_path: Path) -> None:
    kafka_port, http_port = free_ports(2)  # nothing listens there
    env = {
        "TRAINGUARD_HOME": str(tmp_path),
        "TRAINGUARD__STACK__KAFKA_PORT": str(kafka_port),
        "TRAINGUARD__STACK__CLICKHOUSE_HTTP_PORT": str(http_port),
    }
    res = CliRunner().invoke(main, ["stack", "status", "--json"], env=env)
    assert res.exit_code == 1
    st = json.loads(res.output)
    assert not st["healthy"] and not st["kafka"]["healthy"] and not st["clickhouse"]["healthy"]


def test_busy_port_is_a_clear_message(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = StackConfig(home=str(tmp_path), clickhouse_http_port=port, clickhouse_tcp_port=port + 1)
        with pytest.raises(StackError, match=f"port {port} is already in use"):
            ClickHouseServer(cfg).start()
        controller_port, http_port, tcp_port = free_ports(3)
        env = {
            "TRAINGUARD_HOME": str(tmp_path),
            "TRAINGUARD__STACK__KAFKA_PORT": str(port),
            "TRAINGUARD__STACK__KAFKA_CONTROLLER_PORT": str(controller_port),
            "TRAINGUARD__STACK__CLICKHOUSE_HTTP_PORT": str(http_port),
            "TRAINGUARD__STACK__CLICKHOUSE_TCP_PORT": str(tcp_port),
        }
        res = CliRunner().invoke(main, ["stack", "up"], env=env)
        assert res.exit_code != 0 and f"port {port} is already in use" in res.output
        assert "Traceback" not in res.output
        assert not (tmp_path / "clickhouse" / "clickhouse.pid").exists()  # nothing half-started


def test_missing_java_is_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(StackError, match="Java 17\\+ is needed"):
        KafkaServer.java()


def test_external_config_refuses_local_servers() -> None:
    settings = replace(load_settings(environ={}), stack=StackConfig(embedded=False))
    with pytest.raises(StackError, match="embedded is false"):
        Stack(settings).up()


def test_jars_are_cached_between_homes(stack_settings: Settings, tmp_path: Path) -> None:
    # The running stack resolved them once; another home on the same machine reuses them.
    other = KafkaServer(replace(stack_settings.stack, home=str(tmp_path)))
    t0 = time.monotonic()
    libs = other.ensure_jars()
    assert time.monotonic() - t0 < 1.0
    assert (libs / ".complete").exists() and any(libs.glob("kafka_2.13-4.*.jar"))
