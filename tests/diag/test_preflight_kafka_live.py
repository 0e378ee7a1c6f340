"""``trainguard preflight record`` against a real broker of the test's own: a check made while
Kafka is down stays pending in the node's log directory, and the next check, with Kafka back,
publishes both to ``trainguard.telemetry.nodechecks`` (where the sink takes them to
``node_checks``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from kafka import KafkaConsumer

from tests.private_kafka import private_kafka
from trainguard.commands.preflight import preflight
from trainguard.schemas.codec import decode
from trainguard.schemas.telemetry import NodeCheck
from trainguard.schemas.topics import NODE_CHECKS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BAD = {"test": "gemm-digest", "passed": False, "findings": ["cpu: digest 9f86d081... differs"]}


def _record(results: Path, log: Path, config: Path, job: str) -> str:
    args = ["record", str(results), "--diag-exit", "1", "--node", "n3", "--origin", "slurm-prolog"]
    args += ["--job", job, "--action-taken", "drained", "--log-dir", str(log), "--publish-timeout-s", "5"]
    res = CliRunner().invoke(preflight, args, obj={"config_path": str(config), "quiet": True})
    assert res.exit_code == 0, res.output
    return res.output


def test_a_check_made_during_an_outage_is_published_by_the_next(tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(BAD) + "\n")
    log = tmp_path / "log"
    with private_kafka(tmp_path / "home", [NODE_CHECKS]) as (settings, server):
        config = tmp_path / "tg.yaml"
        config.write_text(f"kafka:\n  bootstrap_servers: {settings.kafka.bootstrap_servers}\n")
        server.stop()
        assert "WARNING: not published" in _record(results, log, config, "101")
        assert len(list((log / "n3").glob("*.pending.json"))) == 1
        server.start()
        server.wait_healthy(90)
        assert "published (2 record(s))" in _record(results, log, config, "102")
        assert list((log / "n3").glob("*.pending.json")) == []
        files = sorted((log / "n3").glob("*.json"))
        kept = [e for p in files if isinstance(e := decode(p.read_bytes(), NodeCheck), NodeCheck)]
        assert len(kept) == 2

        consumer = KafkaConsumer(
            NODE_CHECKS.name,
            bootstrap_servers=settings.kafka.bootstrap_servers,
            auto_offset_reset="earliest",
            consumer_timeout_ms=15_000,
        )
        got: list[NodeCheck] = []
        keys: set[bytes] = set()
        try:
            for record in consumer:
                event = decode(record.value, NodeCheck)
                assert isinstance(event, NodeCheck)
                got.append(event)
                keys.add(record.key)
                if len(got) == 2:
                    break
        finally:
            consumer.close()
    assert sorted(got, key=lambda e: e.job) == sorted(kept, key=lambda e: e.job)
    assert [e.job for e in sorted(got, key=lambda e: e.ts_ms)] == ["101", "102"]
    assert keys == {b"n3"}  # keyed by node
