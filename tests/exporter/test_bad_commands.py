"""The exporter's command listener moves past bad commands.

Fast tests drive :class:`CommandListener` with a stand-in consumer; the slow one sends a poison
command and a valid one through the real broker to a real listener.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.streams.harness import Watcher
from tests.waiting import wait_until
from trainguard.infra.bus import EventProducer, signer_for
from trainguard.infra.config import KafkaConfig, Settings
from trainguard.infra.signing import Signer, SigningConfig, Verifier, init_keys
from trainguard.schemas.base import now_ms
from trainguard.schemas.codec import encode
from trainguard.schemas.control import Command, CommandKind, DeadLetter
from trainguard.schemas.topics import COMMANDS, DEAD_LETTERS
from trainguard.streams.exporter.commands import STAGE, CommandListener
from trainguard.streams.exporter.config import CommandsConfig

NODE = "node-bad"


def command(cid: str, kind: CommandKind = CommandKind.SET_INTERVAL, node: str = NODE) -> Command:
    return Command(
        command_id=cid, ts_ms=now_ms(), kind=kind, node=node, args={"source": "host", "interval_s": 1}
    )


def record(value: bytes, offset: int) -> Any:
    return SimpleNamespace(topic=COMMANDS.name, partition=1, offset=offset, key=NODE.encode(), value=value)


class Recorder:
    """The listener's ``handle`` (poison: raises) and ``dead_letter`` callbacks."""

    def __init__(self) -> None:
        self.handled: list[str] = []
        self.dead: list[DeadLetter] = []

    def handle(self, cmd: Command) -> None:
        if cmd.command_id.startswith("poison"):
            raise RuntimeError(f"cannot handle {cmd.command_id}")
        if cmd.command_id.startswith("malformed"):
            raise ValueError("interval_s outside [0.01, 86400]")
        self.handled.append(cmd.command_id)

    def listener(self, kafka: KafkaConfig | None = None, node: str = NODE) -> CommandListener:
        return CommandListener(
            kafka or KafkaConfig(), node, "", CommandsConfig(), self.handle, dead_letter=self.dead.append
        )


def test_a_command_whose_handling_fails_is_dead_lettered_and_the_next_handled() -> None:
    r = Recorder()
    listener = r.listener()
    for i, raw in enumerate(
        [encode(command("poison-1")), b"\xffgarbage", encode(command("malformed-1")), encode(command("ok-1"))]
    ):
        listener.dispatch(record(raw, i))  # never raises
    assert r.handled == ["ok-1"]
    assert [(d.stage, d.offset, d.partition) for d in r.dead] == [(STAGE, 0, 1), (STAGE, 2, 1)]
    assert "RuntimeError: cannot handle poison-1" in r.dead[0].reason
    # garbage is counted and logged, not published by every exporter (the sink dead-letters it)
    assert (listener.dead_lettered, listener.errors, listener.handled) == (2, 3, 1)
    assert listener.last_error == ""  # the last command went through


class FakeConsumer:
    """One batch of records, then nothing; commits and seeks remembered.  ``recent_from``: the
    first offset whose timestamp is within the listener's ``max_age_s`` (None: no such record;
    -1: the lookup fails)."""

    def __init__(self, records: list[Any], pos: int = 0, recent_from: int | None = 0, end: int = 2) -> None:
        self.records, self.commits, self.closed = records, 0, False
        self.pos, self.recent_from, self.end, self.seeks = pos, recent_from, end, []
        self.asked_since: list[int] = []

    def poll(self, timeout_ms: int = 0) -> dict[Any, list[Any]]:
        if self.records:
            recs, self.records = self.records, []
            return {("commands", 1): recs}
        time.sleep(0.02)
        return {}

    def assignment(self) -> set[Any]:
        return {("commands", 1)}

    def position(self, tp: Any) -> int:
        return self.pos

    def offsets_for_times(self, times: dict[Any, int]) -> dict[Any, Any]:
        self.asked_since += list(times.values())
        if self.recent_from == -1:
            raise RuntimeError("this broker keeps no timestamps")
        hit = None if self.recent_from is None else SimpleNamespace(offset=self.recent_from, timestamp=0)
        return {tp: hit for tp in times}

    def end_offsets(self, parts: list[Any]) -> dict[Any, int]:
        return {tp: self.end for tp in parts}

    def seek(self, tp: Any, offset: int) -> None:
        self.seeks.append(offset)

    def commit(self) -> None:
        self.commits += 1

    def close(self, autocommit: bool = True) -> None:
        self.closed = True


def test_the_listener_commits_past_a_bad_command_and_reconnects_when_the_broker_is_away() -> None:
    r = Recorder()
    consumer = FakeConsumer([record(encode(command("poison-2")), 5), record(encode(command("ok-2")), 6)])
    attempts: list[int] = []

    class Listener(CommandListener):
        def _consumer(self) -> Any:
            attempts.append(1)
            if len(attempts) == 1:
                raise ConnectionError("broker away")
            return consumer

    listener = Listener(KafkaConfig(), NODE, "", CommandsConfig(), r.handle, dead_letter=r.dead.append)
    listener.start()
    try:
        wait_until(lambda: r.handled == ["ok-2"], 15, lambda: f"ok-2 handled (handled {r.handled})")
        assert consumer.commits >= 1 and [d.offset for d in r.dead] == [5]
        assert len(attempts) == 2  # the broker away: one reconnect, after a backoff
    finally:
        listener.stop()
    assert isinstance(listener._thread, threading.Thread) and not listener._thread.is_alive()


@pytest.mark.parametrize(
    ("pos", "recent_from", "end", "seeks"),
    [
        (3, 40, 50, [40]),  # down for a while: the stale commands are not read
        (3, None, 50, [50]),  # every command is stale: start at the end
        (45, 40, 50, []),  # the committed offset is already recent: nothing skipped
        (3, -1, 50, []),  # no lookup by time: read from the committed offset, each one checked
    ],
)
def test_a_restarted_listener_starts_at_the_first_command_within_its_max_age(
    pos: int, recent_from: int | None, end: int, seeks: list[int]
) -> None:
    r = Recorder()
    consumer = FakeConsumer([], pos=pos, recent_from=recent_from, end=end)

    class Listener(CommandListener):
        def _consumer(self) -> Any:
            return consumer

    cfg = CommandsConfig()
    listener = Listener(KafkaConfig(), NODE, "", cfg, r.handle, dead_letter=r.dead.append)
    before = now_ms()
    listener.start()
    try:
        assert listener.ready.wait(10)
        assert consumer.seeks == seeks
        (since,) = consumer.asked_since
        assert before - cfg.max_age_s * 1000 <= since <= now_ms() - cfg.max_age_s * 1000
    finally:
        listener.stop()


@pytest.mark.slow
def test_a_poison_command_on_the_real_broker_is_dead_lettered_and_the_next_one_handled(
    stack_settings: Settings,
) -> None:
    node = f"bad-{uuid.uuid4().hex[:8]}"
    r = Recorder()
    listener = CommandListener(stack_settings.kafka, node, "", CommandsConfig(), r.handle)  # own producer
    dead = Watcher(stack_settings, DEAD_LETTERS)
    listener.start()
    try:
        assert listener.ready.wait(60), "command consumer never got its partitions"
        producer = EventProducer(stack_settings.kafka, signer=signer_for(stack_settings, "operator"))
        for c in (command("poison-3", node=node), command("ok-3", node=node)):
            producer.send(c, COMMANDS).get(timeout=30)
        producer.close()
        wait_until(lambda: r.handled == ["ok-3"], 30, lambda: f"ok-3 handled (handled {r.handled})")
        dl = dead.wait_for(lambda e: isinstance(e, DeadLetter) and e.key == node, 30)
        assert isinstance(dl, DeadLetter) and dl.stage == STAGE and dl.topic == COMMANDS.name
        assert "poison-3" in dl.payload and dl.offset >= 0
        assert listener.dead_lettered == 1 and listener.ready.is_set()
    finally:
        listener.stop()
        dead.close()


def test_with_signing_on_only_commands_signed_by_a_trusted_role_run(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    init_keys(keys)
    cfg = SigningConfig(enabled=True, keys_dir=str(keys))
    operator, worker = Signer.load(cfg, tmp_path, "operator"), Signer.load(cfg, tmp_path, "worker")
    r = Recorder()
    listener = CommandListener(
        KafkaConfig(), NODE, "", CommandsConfig(), r.handle, dead_letter=r.dead.append,
        verifier=Verifier.load(cfg, tmp_path),
    )  # fmt: skip

    def signed(cid: str, signer: Signer, offset: int) -> Any:
        value = encode(command(cid))
        rec = record(value, offset)
        rec.headers = signer.headers(COMMANDS.name, NODE.encode(), value)
        return rec

    by_operator = signed("ok-operator", operator, 1)
    listener.dispatch(by_operator)
    listener.dispatch(signed("ok-worker", worker, 2))  # the stream workers' capture commands
    unsigned = record(encode(command("unsigned")), 3)
    unsigned.headers = []
    listener.dispatch(unsigned)
    tampered = signed("tampered", operator, 4)
    tampered.value = tampered.value.replace(b"host", b"gpu")
    listener.dispatch(tampered)
    listener.dispatch(SimpleNamespace(**{**vars(by_operator), "offset": 9}))  # the same record, replayed
    assert r.handled == ["ok-operator", "ok-worker"]
    assert [d.stage for d in r.dead] == [STAGE] * 3
    reasons = " | ".join(d.reason for d in r.dead).lower()
    assert "unsigned" in reasons and "signature" in reasons and "replayed" in reasons
