"""The exporter against real Kafka brokers: events on their topics, commands, broker outage."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.exporter.conftest import make_cfg
from tests.exporter.kafka_helpers import TopicReader
from tests.private_kafka import private_kafka as private_broker
from tests.waiting import wait_until
from trainguard.infra.bus import EventProducer, signer_for
from trainguard.infra.config import Settings
from trainguard.infra.stack.kafka import KafkaServer
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.control import Command, CommandKind
from trainguard.schemas.telemetry import Heartbeat, HostSample, NicSampleBatch
from trainguard.schemas.topics import COMMANDS, HEARTBEATS, HOST, LOGS, NIC
from trainguard.schemas.workload import LogLine
from trainguard.streams.exporter.service import ExporterService

pytestmark = pytest.mark.slow

XID = "[ 9100.000001] NVRM: Xid (PCI:0000:3b:00): 79, pid=77, name=python, GPU has fallen off the bus."


def test_xid_line_and_nic_down_reach_kafka(stack_settings: Settings, root: Path, tmp_path: Path) -> None:
    node = f"it-{uuid.uuid4().hex[:8]}"
    cfg = make_cfg(
        root,
        tmp_path / "state",
        node=node,
        nic={"interval_s": 0.2},
        kernel_log={"interval_s": 0.2},
        host={"interval_s": 5},
        heartbeat={"interval_s": 1},
        process={"enabled": False},
    )
    reader = TopicReader(stack_settings.kafka, [LOGS.name, NIC.name])
    service = ExporterService(cfg, stack_settings.kafka)
    service.start()
    try:
        assert service.commands is not None
        assert service.commands.ready.wait(30), "command consumer never got its partitions"
        mine = lambda ev: getattr(ev, "node", None) == node  # noqa: E731
        first = reader.read_until(mine, lambda got: any(isinstance(e, NicSampleBatch) for e in got))
        assert any(isinstance(e, NicSampleBatch) and e.nics[0].operstate == "up" for e in first)
        # the incident: an Xid in the kernel log and eth0 losing its link
        with open(root / "var/log/kern.log", "a") as fh:
            fh.write(XID + "\n")
        (root / "sys/class/net/eth0/operstate").write_text("down\n")
        (root / "sys/class/net/eth0/carrier").unlink()

        def seen(got: list[Event]) -> bool:
            xid = any(isinstance(e, LogLine) and e.line == XID for e in got)
            down = any(isinstance(e, NicSampleBatch) and e.nics[0].operstate == "down" for e in got)
            return xid and down

        later = reader.read_until(mine, seen)
        assert seen(later)
        (xid,) = [e for e in later if isinstance(e, LogLine) and e.line == XID]
        assert xid.job == "job-t" and xid.source == "kernel"
        eth0 = next(e for e in later if isinstance(e, NicSampleBatch) and e.nics[0].operstate == "down").nics[
            0
        ]
        assert (eth0.name, eth0.carrier) == ("eth0", None)
        # the fixture's 18 interesting lines went out too, each exactly once
        lines = [e for e in first + later if isinstance(e, LogLine)]
        assert len(lines) == len({e.seq for e in lines}) == 19
        # runtime interval change through the command topic
        producer = EventProducer(stack_settings.kafka, signer=signer_for(stack_settings, "operator"))
        cmd = Command(
            command_id=uuid.uuid4().hex,
            ts_ms=now_ms(),
            kind=CommandKind.SET_INTERVAL,
            node=node,
            args={"source": "host", "interval_s": 0.25},
        )
        bad = Command(
            command_id=uuid.uuid4().hex,
            ts_ms=now_ms(),
            kind=CommandKind.SET_INTERVAL,
            node=node,
            args={"source": "gpus", "interval_s": 1},
        )
        other = Command(
            command_id=uuid.uuid4().hex,
            ts_ms=now_ms(),
            kind=CommandKind.SET_INTERVAL,
            node="another-node",
            args={"source": "host", "interval_s": 99},
        )
        for c in (other, bad, cmd):
            producer.send(c, COMMANDS).get(timeout=30)
        producer.close()
        wait_until(
            lambda: service.exporter.intervals["host"] == 0.25,
            30,
            lambda: f"the host interval set to 0.25 s by command; intervals {service.exporter.intervals}",
        )
        assert (service.commands.errors, service.commands.handled) == (
            1,
            1,
        )  # "gpus" refused, other node skipped
    finally:
        service.stop()
        reader.close()
    assert service.spool.pending_records == 0


@pytest.fixture
def private_kafka(tmp_path: Path) -> Iterator[tuple[Settings, KafkaServer]]:
    """A second broker on free ports: stopping it disturbs nobody else."""
    with private_broker(tmp_path / "kafka-home", [HEARTBEATS, HOST, LOGS, NIC]) as started:
        yield started


# A private broker started, stopped and started again (each start allowed 90 s), the spool drained
# and everything read back: its own waits allow up to about 400 s, more than the 300 s default.
@pytest.mark.timeout(600)
def test_broker_outage_loses_no_sample(
    private_kafka: tuple[Settings, KafkaServer], root: Path, tmp_path: Path
) -> None:
    settings, server = private_kafka
    node = f"outage-{uuid.uuid4().hex[:8]}"
    cfg = make_cfg(
        root,
        tmp_path / "state",
        node=node,
        heartbeat={"interval_s": 0.1},
        host={"interval_s": 0.2},
        nic={"enabled": False},
        kernel_log={"enabled": False},
        process={"enabled": False},
        reporter={"enabled": False},
        commands={"enabled": False},
        delivery={"delivery_timeout_ms": 5000, "spool_segment_bytes": 4096},
    )
    service = ExporterService(cfg, settings.kafka)
    service.start()
    try:
        wait_until(lambda: service.delivery.delivered > 5, 30, "the first records delivered")
        assert server.stop()
        down_at = service.exporter._health["heartbeat"].rounds
        # Sampling goes on into the spool while the broker is down.
        wait_until(
            lambda: (
                service.exporter._health["heartbeat"].rounds >= down_at + 20
                and service.spool.pending_records > 20
            ),
            30,
            lambda: (
                f"20 heartbeat rounds spooled with the broker down (rounds since: "
                f"{service.exporter._health['heartbeat'].rounds - down_at}, "
                f"spooled: {service.spool.pending_records})"
            ),
        )
        assert server.start()
        server.wait_healthy(90)
        wait_until(
            lambda: service.spool.pending_records < 5 and service.delivery.connected,
            60,
            lambda: (
                f"the spool drained after the broker came back (pending {service.spool.pending_records}, "
                f"connected {service.delivery.connected})"
            ),
        )
    finally:
        service.stop(drain_timeout_s=30)
    beats = service.exporter._health["heartbeat"].rounds
    hosts = service.exporter._health["host"].rounds
    assert service.spool.pending_records == 0 and service.spool.dropped_records == 0
    reader = TopicReader(settings.kafka, [HEARTBEATS.name, HOST.name], from_beginning=True)
    try:
        mine = lambda ev: getattr(ev, "node", None) == node  # noqa: E731
        got = reader.read_until(
            mine, lambda g: len({e.seq for e in g if isinstance(e, Heartbeat)}) >= beats, timeout_s=60
        )
        got += reader.read_until(mine, lambda g: False, timeout_s=1.5)  # anything beyond (duplicates)
    finally:
        reader.close()
    seqs = sorted({e.seq for e in got if isinstance(e, Heartbeat)})
    assert seqs == list(range(beats)), f"missing heartbeats: {sorted(set(range(beats)) - set(seqs))[:20]}"
    host_ts = {e.ts_ms for e in got if isinstance(e, HostSample)}
    assert len(host_ts) >= hosts - 1  # two host rounds can share a millisecond; none is lost
    n_hb = sum(isinstance(e, Heartbeat) for e in got)
    print(f"heartbeats {beats}, host samples {hosts}, duplicates {n_hb - beats}")
