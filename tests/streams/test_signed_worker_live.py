"""A stream worker with ``signing.enabled`` on the real broker: its decisions go out signed by the
worker key, and a control command nobody trusted signed is dead-lettered, never applied."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition

from tests.net import free_port
from tests.streams.conftest import FAST_ENV
from tests.streams.harness import Watcher, WorkerProcess, send, unique
from tests.waiting import wait_until
from trainguard.infra.bus import EventProducer
from trainguard.infra.config import Settings
from trainguard.infra.signing import AuthError, SigningConfig, Verifier, init_keys
from trainguard.schemas.base import now_ms
from trainguard.schemas.codec import decode
from trainguard.schemas.control import Command, CommandKind, DeadLetter, Decision
from trainguard.schemas.topics import CONTROL, DEAD_LETTERS, DECISIONS
from trainguard.schemas.workload import LogLine

pytestmark = pytest.mark.slow
XID = "[ 8123.456789] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."


@pytest.fixture(scope="module")
def signed_worker(
    stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerProcess, Settings]]:
    keys = Path(tmp_path_factory.mktemp("keys")) / "keys"
    init_keys(keys)
    settings = replace(stack_settings, signing=SigningConfig(enabled=True, keys_dir=str(keys)))
    env = {**FAST_ENV, "TRAINGUARD__SIGNING__ENABLED": "true", "TRAINGUARD__SIGNING__KEYS_DIR": str(keys)}
    log = Path(tmp_path_factory.mktemp("signed-worker")) / "worker.log"
    w = WorkerProcess(unique("tg-signed"), free_port(), log, env, settings).start()
    yield w, settings
    w.stop()


def test_decisions_go_out_signed_and_forged_control_is_dead_lettered(
    signed_worker: tuple[WorkerProcess, Settings],
) -> None:
    worker, settings = signed_worker
    verifier = Verifier.load(settings.signing, settings.stack.home_path)
    consumer = KafkaConsumer(**settings.kafka.client_kwargs(), group_id=None, enable_auto_commit=False)
    parts = [TopicPartition(DECISIONS.name, p) for p in range(DECISIONS.partitions)]
    consumer.assign(parts)
    consumer.seek_to_end(*parts)
    for tp in parts:
        consumer.position(tp)  # resolve "end" now, before the Xid goes out
    dead = Watcher(settings, DEAD_LETTERS)
    try:
        job, node = unique("signed"), unique("node")
        send(settings, LogLine(node=node, ts_ms=now_ms(), source="kernel", line=XID, seq=1, job=job))

        unsigned: list[str] = []

        def signed_decision() -> str | None:
            # Other workers on the shared stack (unsigned) may decide the same: only ours counts.
            for recs in consumer.poll(timeout_ms=500).values():
                for rec in recs:
                    ev = decode(rec.value)
                    if not (isinstance(ev, Decision) and ev.job == job):
                        continue
                    where = (rec.topic, rec.partition, rec.offset)
                    try:
                        return verifier.verify(rec.topic, rec.key, rec.value, rec.headers, now_ms(), where)
                    except AuthError as exc:
                        unsigned.append(str(exc))
            return None

        principal = wait_until(
            signed_decision, 60, lambda: f"a signed decision for {job} (others: {unsigned})"
        )
        assert principal == "worker"

        forged = Command(
            command_id=unique("forged"),
            ts_ms=now_ms(),
            kind=CommandKind.SET_THRESHOLD,
            job=job,
            args={"path": "decide.incident_max_s", "value": 0.0, "app_id": worker.app_id},
        )
        EventProducer(settings.kafka).send(forged, CONTROL).get(timeout=30)  # no signer: unsigned
        dl = dead.wait_for(
            lambda e: isinstance(e, DeadLetter) and e.stage == "auth" and forged.command_id in e.payload, 60
        )
        assert isinstance(dl, DeadLetter) and dl.topic == CONTROL.name and "unsigned" in dl.reason.lower()
    finally:
        consumer.close()
        dead.close()
