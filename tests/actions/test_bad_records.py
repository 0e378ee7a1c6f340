"""The action service moves past bad records (fast: no broker, the loop driven through its seams).

A fake decisions source feeds consumed records to :meth:`ActionService.tick`; a fake producer
keeps what the service publishes (dead letters, action events).  A record that decodes but fails
in handling is dead-lettered with its stage and coordinates and committed past; the store or the
broker being down is not the record's fault: nothing is committed, the records are read again.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from actions.config import ActionsConfig
from actions.executors.base import ExecutorEnv
from actions.executors.dry_run import DryRunConfig, DryRunExecutor
from actions.service import ActionService, JobsFollower, transient
from actions.state import RecoveryState
from infra.backoff import Backoff
from infra.bus import Batch, decode_record
from infra.config import load_settings
from schemas.base import Event
from schemas.codec import DecodeError, encode
from schemas.control import ActionEvent, ActionPhase, DeadLetter, Decision, JobSpec
from schemas.enums import Action
from schemas.topics import DEAD_LETTERS, DECISIONS, JOBS
from tests.actions.conftest import job_spec, make_decision

JOB = "job-bad"


class Sent:
    def get(self, timeout: float | None = None) -> None:
        return None


class FakeProducer:
    """What the service publishes, by topic name."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Event]] = []
        self.flushes = 0

    def send(self, event: Event, topic: Any = None) -> Sent:
        self.sent.append((topic.name if topic is not None else "", event))
        return Sent()

    def flush(self, timeout_s: float | None = 30.0) -> None:
        self.flushes += 1

    def close(self, timeout_s: float = 10.0) -> None:
        pass

    def dead_letters(self) -> list[DeadLetter]:
        return [e for t, e in self.sent if t == DEAD_LETTERS.name and isinstance(e, DeadLetter)]


def record(value: bytes, offset: int, topic: str = DECISIONS.name, partition: int = 0) -> Any:
    return SimpleNamespace(topic=topic, partition=partition, offset=offset, key=JOB.encode(), value=value)


class FakeDecisions:
    """Consumed records, decoded as :class:`infra.bus.EventConsumer` does; re-read after seek_back."""

    def __init__(self, records: list[Any]) -> None:
        self.pending = list(records)
        self.committed: list[int] = []  # the offset of the next record at each commit
        self.position = 0
        self.seeks: list[list[int]] = []
        self.poll_error: Exception | None = None
        self.commit_error: Exception | None = None

    def poll(self, timeout_ms: int = 1000) -> Batch:
        if self.poll_error is not None:
            exc, self.poll_error = self.poll_error, None
            raise exc
        recs, self.pending = self.pending, []
        events, dead, sources = [], [], []
        for r in recs:
            out = decode_record(r)
            if isinstance(out, DeadLetter):
                dead.append(out)
            else:
                events.append(out)
                sources.append(r)
        if recs:
            self.position = recs[-1].offset + 1
        return Batch(events, dead, sources)

    def commit(self) -> None:
        if self.commit_error is not None:
            exc, self.commit_error = self.commit_error, None
            raise exc
        self.committed.append(self.position)

    def seek_back(self, records: Sequence[Any]) -> None:
        self.seeks.append([r.offset for r in records])
        self.pending = list(records) + self.pending

    def close(self) -> None:
        pass


class FakeJobsConsumer:
    """The jobs reader's kafka-python consumer: hands out its records once (again after seek)."""

    def __init__(self, records: list[Any]) -> None:
        self.pending = list(records)
        self.all = list(records)

    def poll(self, timeout_ms: int = 0, max_records: int | None = None) -> dict[Any, list[Any]]:
        recs, self.pending = self.pending, []
        return {("jobs", 0): recs} if recs else {}

    def seek(self, tp: Any, offset: int) -> None:
        self.pending = [r for r in self.all if r.offset >= offset]

    def close(self) -> None:
        pass


def decision_bytes(d: Decision, **replace: str) -> bytes:
    """``d`` on the wire, with JSON text substituted (to write what ``encode`` refuses to)."""
    text = encode(d).decode()
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    return text.encode()


def lone_surrogate(d: Decision) -> bytes:
    """Decodes fine; storing it fails (``encode`` cannot write a lone surrogate as UTF-8)."""
    return decision_bytes(d, **{'"reason":"test"': '"reason":"te\\ud800st"'})


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[ActionService, FakeProducer]]:
    cfg = ActionsConfig(group_id="unit", jobs=[JOB], state_dir=str(tmp_path / "actions"), spec_wait_s=0)
    executor = DryRunExecutor(DryRunConfig(), ExecutorEnv(state_dir=tmp_path / "executor"))
    producer = FakeProducer()
    svc = ActionService(load_settings(environ={}), cfg, executor=executor, producer=producer)  # type: ignore[arg-type]
    svc.backoff = Backoff(initial_s=0.0, max_s=0.0)
    svc.crash_pause_s = 0.0
    yield svc, producer
    svc.shutdown(5)


def start(svc: ActionService, decisions: list[Any], jobs: list[Any] | None = None) -> FakeDecisions:
    source = FakeDecisions(decisions)
    follower = JobsFollower(
        svc.settings, svc.store, svc.wanted, svc.reject, consumer=FakeJobsConsumer(jobs or [])
    )
    svc.start_consuming(consumer=source, jobs=follower)
    svc.dispatch = lambda: None  # type: ignore[method-assign]  # no recoveries run in these tests
    return source


def test_a_decision_that_fails_in_accept_is_dead_lettered_and_the_next_one_accepted(
    service: tuple[ActionService, FakeProducer],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    svc, producer = service
    poison, good = make_decision(JOB, Action.EVICT, ["m1"]), make_decision(JOB, Action.EVICT, ["m2"])
    real = svc.store.accept

    def accept(decision: Decision, now_ms: int) -> bool:  # decodes fine, then the store raises
        if decision.decision_id == poison.decision_id:
            raise ValueError("Exceeds the limit (4300 digits) for integer string conversion")
        return real(decision, now_ms)

    monkeypatch.setattr(svc.store, "accept", accept)
    source = start(svc, [record(encode(poison), 7), record(encode(good), 8)])
    with caplog.at_level(logging.ERROR, logger="actions.service"):
        svc.tick(0)  # never raises
    assert svc.store.get(good.decision_id) is not None
    assert svc.store.get(poison.decision_id) is None
    (dl,) = producer.dead_letters()
    assert (dl.topic, dl.partition, dl.offset, dl.stage) == (DECISIONS.name, 0, 7, "actions:accept")
    assert dl.reason.startswith("ValueError: Exceeds the limit") and poison.decision_id in dl.payload
    assert source.committed == [9]  # past both records
    assert producer.flushes >= 1  # the dead letter was flushed before the commit
    assert (svc.accepted, svc.dead_lettered) == (1, 1)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "actions:accept" in errors[0].getMessage()
    assert f"{DECISIONS.name}[0]@7" in errors[0].getMessage()


def test_a_lone_surrogate_never_reaches_the_store(service: tuple[ActionService, FakeProducer]) -> None:
    """Rejected by the decoder or by the store's encode (whichever sees it first): dead-lettered."""
    svc, producer = service
    poison, good = make_decision(JOB, Action.EVICT, ["m1"]), make_decision(JOB, Action.EVICT, ["m2"])
    source = start(svc, [record(lone_surrogate(poison), 7), record(encode(good), 8)])
    svc.tick(0)
    assert svc.store.get(good.decision_id) is not None and svc.store.get(poison.decision_id) is None
    assert svc.dead_lettered == 1 and source.committed == [9]
    # The decoder's rejection is published by the consumer (EventConsumer); the store's by the service.
    assert [d.stage for d in producer.dead_letters()] in ([], ["actions:accept"])


def test_the_store_never_keeps_what_it_cannot_read_back(service: tuple[ActionService, FakeProducer]) -> None:
    svc, _ = service
    d = make_decision(JOB, Action.EVICT, ["m1"])
    bad = Decision(**{**d.__dict__, "reason": "te\ud800st"})
    with pytest.raises((ValueError, DecodeError)):  # encode's UnicodeEncodeError, or the read-back
        svc.store.accept(bad, 1)
    assert svc.store.get(d.decision_id) is None


def test_an_undecodable_decision_is_dead_lettered_and_skipped(
    service: tuple[ActionService, FakeProducer],
) -> None:
    svc, _ = service
    good = make_decision(JOB, Action.RESTART)
    huge = decision_bytes(
        make_decision(JOB, Action.EVICT, ["m1"]), **{'"evidence":{}': '"evidence":{"n":' + "1" * 4301 + "}"}
    )
    source = start(svc, [record(huge, 1), record(b"\xff\x00", 2), record(encode(good), 3)])
    svc.tick(0)
    assert svc.store.get(good.decision_id) is not None
    assert svc.dead_lettered == 2 and source.committed == [4]


def test_the_store_down_is_retried_not_dead_lettered(
    service: tuple[ActionService, FakeProducer], monkeypatch: pytest.MonkeyPatch
) -> None:
    svc, producer = service
    a, b = make_decision(JOB, Action.EVICT, ["m1"]), make_decision(JOB, Action.EVICT, ["m2"])
    source = start(svc, [record(encode(a), 10), record(encode(b), 11)])
    real, calls = svc.store.accept, []

    def locked_once(decision: Decision, now_ms: int) -> bool:
        calls.append(decision.decision_id)
        if len(calls) == 2:
            raise sqlite3.OperationalError("database is locked")
        return real(decision, now_ms)

    monkeypatch.setattr(svc.store, "accept", locked_once)
    svc.tick(0)
    assert source.committed == [] and source.seeks == [[11]]  # b read again, nothing committed
    assert producer.dead_letters() == []
    svc.tick(0)
    assert svc.store.get(b.decision_id) is not None and source.committed == [12]
    assert calls == [a.decision_id, b.decision_id, b.decision_id]


def test_the_broker_down_never_escapes_tick(service: tuple[ActionService, FakeProducer]) -> None:
    svc, _ = service
    d = make_decision(JOB, Action.EVICT, ["m1"])
    source = start(svc, [record(encode(d), 5)])
    source.poll_error = ConnectionError("broker away")
    svc.tick(0)
    assert svc.store.get(d.decision_id) is None
    source.commit_error = ConnectionError("broker away")
    svc.tick(0)  # accepted, the commit failed: read again (a redelivery, a no-op)
    assert source.seeks == [[5]] and source.committed == []
    svc.tick(0)
    assert source.committed == [6] and (svc.accepted, svc.redelivered) == (1, 1)


def test_a_bad_job_spec_is_dead_lettered_and_the_next_one_kept(
    service: tuple[ActionService, FakeProducer], monkeypatch: pytest.MonkeyPatch
) -> None:
    svc, producer = service
    poison, good = job_spec(JOB, n=2), job_spec(JOB)
    surrogate = encode(job_spec(JOB)).decode().replace(f'"{JOB}-n0"', '"\\udc80-n0"').encode()
    real = svc.store.save_spec

    def save_spec(spec: JobSpec) -> bool:  # decodes fine, then the store raises
        if spec == poison:
            raise TypeError("a spec the store cannot take")
        return real(spec)

    monkeypatch.setattr(svc.store, "save_spec", save_spec)
    jobs = [encode(poison), b"not json", surrogate, encode(good)]
    start(svc, [], jobs=[record(v, i, JOBS.name) for i, v in enumerate(jobs)])
    svc.tick(0)
    assert svc.store.spec(JOB) == good
    stages = {d.offset: d.stage for d in producer.dead_letters()}
    assert stages[0] == "actions:jobs" and stages[1] == "decode"
    assert stages[2] in ("decode", "actions:jobs")  # the decoder or the store refuses a lone surrogate
    assert svc.dead_lettered == 3


def test_the_store_down_while_following_jobs_reads_the_spec_again(
    service: tuple[ActionService, FakeProducer], monkeypatch: pytest.MonkeyPatch
) -> None:
    svc, producer = service
    spec = job_spec(JOB)
    start(svc, [], jobs=[record(encode(spec), 0, JOBS.name)])
    real, calls = svc.store.save_spec, []

    def down_once(s: JobSpec) -> bool:
        calls.append(s.job)
        if len(calls) == 1:
            raise sqlite3.OperationalError("disk I/O error")
        return real(s)

    monkeypatch.setattr(svc.store, "save_spec", down_once)
    svc.tick(0)
    assert svc.store.spec(JOB) is None
    svc.tick(0)
    assert svc.store.spec(JOB) == spec and producer.dead_letters() == []


def test_a_recovery_that_keeps_crashing_is_failed_and_dead_lettered(
    service: tuple[ActionService, FakeProducer], monkeypatch: pytest.MonkeyPatch
) -> None:
    svc, producer = service
    d = make_decision(JOB, Action.EVICT, ["m1"])
    start(svc, [record(encode(d), 42, partition=3)])
    svc.tick(0)
    assert svc.store.get(d.decision_id) is not None

    def broken(decision_id: str) -> Any:
        raise KeyError("a planning bug")

    monkeypatch.setattr(svc.runner, "run", broken)
    for _ in range(3):
        svc._work(JOB)  # what each dispatch's worker thread runs
    rec = svc.store.get(d.decision_id)
    assert rec is not None and rec.state is RecoveryState.FAILED and "crashed 3 times" in rec.detail
    (dl,) = producer.dead_letters()
    assert (dl.stage, dl.partition, dl.offset, dl.topic) == ("actions:recover", 3, 42, DECISIONS.name)
    ends = [e for _, e in producer.sent if isinstance(e, ActionEvent) and e.step == "recovery"]
    assert [e.phase for e in ends] == [ActionPhase.FAILED]
    assert svc.store.head_of_job(JOB) is None  # the job's queue moved on


def test_transient_tells_the_world_down_from_a_bad_record() -> None:
    assert transient(sqlite3.OperationalError("database is locked")) and transient(OSError("disk full"))
    assert not transient(UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"))
    assert not transient(ValueError("Exceeds the limit (4300 digits)")) and not transient(KeyError("x"))
