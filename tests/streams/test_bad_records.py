"""The worker moves past bad records (fast: no broker; a stand-in Faust app keeps what is sent).

Every agent handles each record in :meth:`WorkerContext.guard`, every whole-topic reader (control,
job specs) in :meth:`WorkerContext.handle_followed`: a record that fails to decode or fails in its
handling is dead-lettered (stage ``worker:<agent>``), counted, and the next record is handled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from trainguard.infra.bus import dead_letter_for, decode_record
from trainguard.infra.config import load_settings
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.codec import decode, encode
from trainguard.schemas.control import Command, CommandKind, DeadLetter, Detection
from trainguard.schemas.topics import CONTROL, DEAD_LETTERS, DETECTIONS
from trainguard.streams.agents import control
from trainguard.streams.config import WorkerConfig
from trainguard.streams.context import WorkerContext


class FakeTopic:
    def __init__(self, name: str, sent: list[tuple[str, bytes]]) -> None:
        self.name, self.sent = name, sent

    async def send(self, key: Any = None, value: bytes = b"", headers: Any = None) -> None:
        self.sent.append((self.name, value))


class FakeApp:
    """Just what :class:`WorkerContext` calls on a Faust app outside the agents."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def topic(self, *names: str, **kw: Any) -> FakeTopic:
        return FakeTopic(names[0], self.sent)

    def dead_letters(self) -> list[DeadLetter]:
        out = [decode(v) for t, v in self.sent if t == DEAD_LETTERS.name]
        return [d for d in out if isinstance(d, DeadLetter)]


def make_ctx(**cfg: Any) -> tuple[WorkerContext, FakeApp]:
    app = FakeApp()
    # Unsigned: these records are bad in their content; forged and unsigned records are
    # tests/streams/test_signed_worker_live.py's business.
    settings = load_settings(environ={"TRAINGUARD__SIGNING__ENABLED": "false"})
    return WorkerContext(settings=settings, cfg=WorkerConfig(**cfg), app=app), app


def message(value: bytes, offset: int, topic: str = DETECTIONS.name) -> Any:
    return SimpleNamespace(topic=topic, partition=2, offset=offset, key=b"job-x", value=value)


def event(value: bytes, offset: int) -> Any:
    """A Faust event as the agents see it (``.message`` carries the coordinates)."""
    return SimpleNamespace(message=message(value, offset), value=value, key=b"job-x")


def detection(i: int) -> Detection:
    return Detection(detection_id=f"d{i}", ts_ms=now_ms(), job="job-x", kind="xid_79", category="cuda_error")


HUGE = b'{"schema":"detection","version":1,"n":' + b"1" * 4301 + b"}"


def metric(ctx: WorkerContext, agent: str) -> float:
    return ctx.metrics.registry.get_sample_value("trainguard_dead_letters_total", {"agent": agent}) or 0.0


def test_decode_record_never_raises() -> None:
    out = decode_record(message(HUGE, 1))
    assert isinstance(out, DeadLetter) and out.offset == 1 and "4300" in out.reason


def test_a_dead_letter_quoting_a_lone_surrogate_can_still_be_sent() -> None:
    dl = dead_letter_for(message(b"{}", 1), "bad value 'x\ud800'", "worker:x")
    assert "\\ud800" in dl.reason
    decode(encode(dl))


def test_an_agent_dead_letters_a_record_its_handling_fails_on_and_handles_the_next(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctx, app = make_ctx()
    handled: list[str] = []

    async def body(ev: Event) -> None:
        assert isinstance(ev, Detection)
        if ev.detection_id == "d1":
            raise KeyError("a bug in the detector")
        handled.append(ev.detection_id)

    async def run() -> None:
        for i in range(3):
            await ctx.guard(event(encode(detection(i)), 10 + i), "decide", body)

    with caplog.at_level(logging.ERROR, logger="trainguard.streams.context"):
        asyncio.run(run())
    assert handled == ["d0", "d2"]
    (dl,) = app.dead_letters()
    assert (dl.topic, dl.partition, dl.offset, dl.stage) == (DETECTIONS.name, 2, 11, "worker:decide")
    assert "KeyError" in dl.reason
    assert metric(ctx, "decide") == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and f"{DETECTIONS.name}[2]@11" in errors[0]


@pytest.mark.parametrize("sink", [True, False])
def test_an_undecodable_record_never_stops_an_agent(sink: bool) -> None:
    ctx, app = make_ctx(sink_enabled=sink)
    handled: list[Event] = []

    async def body(ev: Event) -> None:
        handled.append(ev)

    async def run() -> None:
        for i, raw in enumerate([HUGE, b"\xff", encode(detection(3))]):
            await ctx.guard(event(raw, i), "decide", body)

    asyncio.run(run())
    assert len(handled) == 1
    # With a sink, the sink dead-letters garbage (it reads every topic); without, the agent does.
    assert [d.stage for d in app.dead_letters()] == ([] if sink else ["decode", "decode"])


def test_a_record_naming_a_job_with_a_path_is_dead_lettered_and_the_next_handled() -> None:
    """A bad name is a decode error like any other: dead-lettered, never handed to an agent."""
    ctx, app = make_ctx(sink_enabled=False)
    handled: list[Event] = []

    async def body(ev: Event) -> None:
        handled.append(ev)

    bad = encode(detection(1)).replace(b'"job":"job-x"', b'"job":"../../etc/x"')
    assert bad != encode(detection(1))

    async def run() -> None:
        for i, raw in enumerate([bad, encode(detection(2))]):
            await ctx.guard(event(raw, i), "decide", body)

    asyncio.run(run())
    assert [ev.detection_id for ev in handled if isinstance(ev, Detection)] == ["d2"]
    (dl,) = app.dead_letters()
    assert (dl.stage, dl.offset) == ("decode", 0)
    assert "detection.job: name '../../etc/x' holds '/'" in dl.reason


def test_a_followed_record_that_fails_is_dead_lettered_and_the_reader_goes_on() -> None:
    ctx, app = make_ctx()
    seen: list[bytes | None] = []

    def handle(raw: bytes | None) -> None:
        if raw == b"poison":
            raise RuntimeError("cannot apply")
        seen.append(raw)

    async def run() -> None:
        for i, raw in enumerate([b"poison", b"fine"]):
            await ctx.handle_followed(message(raw, i, CONTROL.name), handle, "control")

    asyncio.run(run())
    assert seen == [b"fine"]
    (dl,) = app.dead_letters()
    assert (dl.stage, dl.offset, dl.topic) == ("worker:control", 0, CONTROL.name)
    assert metric(ctx, "control") == 1


def control_handle(ctx: WorkerContext) -> tuple[Callable[[bytes | None], None], list[WorkerConfig]]:
    got: list[Callable[[bytes | None], None]] = []
    changes: list[WorkerConfig] = []
    ctx.follow = lambda topic, handle, name: got.append(handle)  # type: ignore[method-assign]
    control.register(ctx, changes.append)
    return got[0], changes


def set_threshold(path: str, value: Any) -> bytes:
    cmd = Command(
        command_id=f"cmd-{path}",
        ts_ms=now_ms(),
        kind=CommandKind.SET_THRESHOLD,
        args={"path": path, "value": value},
    )
    return encode(cmd)


def test_a_control_command_that_cannot_be_applied_is_dead_lettered_and_the_next_applied() -> None:
    ctx, app = make_ctx()
    handle, changes = control_handle(ctx)
    records = [
        set_threshold("decide.no_such_setting", 1),  # decodes; the config rejects it
        HUGE,  # does not decode (the sink dead-letters it; a ValueError here: the reader does)
        set_threshold("decide.incident_max_s", 7.0),
    ]

    async def run() -> None:
        for i, raw in enumerate(records):
            await ctx.handle_followed(message(raw, i, CONTROL.name), handle, "control")

    asyncio.run(run())
    assert ctx.cfg.decide.incident_max_s == 7.0 and len(changes) == 1
    stages = {d.offset: d for d in app.dead_letters()}
    assert stages[0].stage == "worker:control" and "rejected control command cmd-decide.no_such_setting" in (
        stages[0].reason
    )
    assert 2 not in stages


def test_a_control_change_the_detectors_refuse_keeps_the_last_good_config() -> None:
    ctx, app = make_ctx()
    got: list[Callable[[bytes | None], None]] = []
    ctx.follow = lambda topic, handle, name: got.append(handle)  # type: ignore[method-assign]

    def on_change(new: WorkerConfig) -> None:
        if new.decide.incident_max_s == 1.0:
            raise RuntimeError("detector refused")

    control.register(ctx, on_change)

    async def run() -> None:
        await ctx.handle_followed(
            message(set_threshold("decide.incident_max_s", 1.0), 0, CONTROL.name), got[0], "control"
        )

    asyncio.run(run())
    assert ctx.cfg.decide.incident_max_s == WorkerConfig().decide.incident_max_s
    assert [d.stage for d in app.dead_letters()] == ["worker:control"]


@pytest.mark.parametrize("sink", [True, False])
def test_garbage_on_a_followed_topic_is_logged_with_its_coordinates(
    sink: bool, caplog: pytest.LogCaptureFixture
) -> None:
    ctx, app = make_ctx(sink_enabled=sink)
    handle, _ = control_handle(ctx)

    async def run() -> None:
        await ctx.handle_followed(message(b"\xffgarbage", 9, CONTROL.name), handle, "control")
        await ctx.handle_followed(
            message(set_threshold("decide.incident_max_s", 5.0), 10, CONTROL.name), handle, "control"
        )

    with caplog.at_level(logging.ERROR, logger="trainguard.streams.context"):
        asyncio.run(run())
    assert ctx.cfg.decide.incident_max_s == 5.0
    assert any(f"{CONTROL.name}[2]@9" in r.getMessage() for r in caplog.records)
    # With a sink, the sink dead-letters garbage once for every worker; without, the reader does.
    assert [(d.stage, d.offset) for d in app.dead_letters()] == ([] if sink else [("decode", 9)])
