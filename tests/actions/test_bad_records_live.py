"""The action service against real brokers moves past bad decisions and job specs, and waits
out the store or the broker being down (integration, slow).

What makes a record bad here is the store refusing it (patched on the running service: the
decoder now rejects the natural examples, a lone surrogate or a 4,301-digit integer, before the
store sees them); garbage on the wire rides along and must be dead-lettered too.  The store being
down is a transient ``sqlite3.OperationalError`` raised the same way; the broker being down is a
private broker of the test's own, really stopped and started again.  The pure decisions behind
all this (what is transient, what the decoder rejects) are tested in ``test_bad_records.py``.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.actions.conftest import Running, job_spec, make_decision
from tests.private_kafka import private_kafka as private_broker
from tests.streams.harness import Watcher, send, unique
from tests.waiting import wait_until
from trainguard.actions.config import ActionsConfig
from trainguard.actions.executors.base import ExecutorEnv
from trainguard.actions.executors.dry_run import DryRunConfig, DryRunExecutor
from trainguard.actions.progress import Recovery
from trainguard.actions.service import ActionService
from trainguard.actions.state import RecoveryState
from trainguard.infra.backoff import Backoff
from trainguard.infra.bus import EventProducer, signer_for
from trainguard.infra.config import Settings
from trainguard.infra.stack.kafka import KafkaServer
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.codec import encode
from trainguard.schemas.control import ActionEvent, ActionPhase, DeadLetter, Decision, JobSpec
from trainguard.schemas.enums import Action
from trainguard.schemas.topics import ACTIONS, DEAD_LETTERS, DECISIONS, JOBS

pytestmark = pytest.mark.slow
Start = Callable[..., Running]
HUGE = b'{"schema":"decision","version":1,"n":' + b"1" * 4301 + b"}"


def lone_surrogate(event: Decision | JobSpec) -> bytes:
    """``event`` on the wire with a lone surrogate written into its JSON (``encode`` refuses to)."""
    text = encode(event).decode()
    old = f'"{event.job}"'
    assert old in text
    return text.replace(old, f'"\\ud800{event.job}"', 1).encode()


def dead_letter(w: Watcher, stage: str, key: str) -> DeadLetter:
    def mine(e: Event) -> bool:
        return isinstance(e, DeadLetter) and e.stage == stage and e.key == key

    found = w.wait_for(mine)
    assert isinstance(found, DeadLetter)
    return found


def dead_letters(w: Watcher, key: str, n: int) -> list[DeadLetter]:
    """The first ``n`` dead letters keyed ``key`` (waiting for them)."""

    def mine() -> list[DeadLetter] | None:
        got = [e for e in w.all(lambda e: isinstance(e, DeadLetter) and e.key == key)]
        return [e for e in got if isinstance(e, DeadLetter)] if len(got) >= n else None

    return wait_until(mine, 30, lambda: f"{n} dead letters keyed {key}; saw {w.seen[-5:]}", interval_s=0)


def produce(settings: Settings, event: Event) -> tuple[int, int]:
    """Send ``event`` and return the (partition, offset) it was written at."""
    p = EventProducer(settings.kafka, signer=signer_for(settings, "operator"))
    try:
        md = p.send(event).get(timeout=30)
    finally:
        p.close()
    return int(md.partition), int(md.offset)


def committed(settings: Settings, group: str, topic: str, partition: int) -> int:
    """The offset ``group`` has committed on ``topic[partition]`` (-1 for none)."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(**settings.kafka.client_kwargs(), group_id=group, enable_auto_commit=False)
    try:
        offset = c.committed(TopicPartition(topic, partition))
    finally:
        c.close()
    return -1 if offset is None else int(offset)


def test_a_poison_decision_is_dead_lettered_and_the_next_one_acted_on(
    start_service: Start, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="trainguard.actions.service")
    job = unique("job-poison")
    run = start_service([job])
    dead = Watcher(run.settings, DEAD_LETTERS)
    poison, valid = (
        make_decision(job, Action.EVICT, [f"{job}-n1"]),
        make_decision(job, Action.EVICT, [f"{job}-n2"]),
    )
    real = run.service.store.accept

    def accept(decision: Decision, now_ms: int) -> bool:  # decodes, then the store raises
        if decision.decision_id == poison.decision_id:
            raise ValueError("Exceeds the limit (4300 digits) for integer string conversion")
        return real(decision, now_ms)

    run.service.store.accept = accept  # type: ignore[method-assign]
    try:
        send(run.settings, job_spec(job))
        garbage = [HUGE, lone_surrogate(make_decision(job, Action.EVICT, [f"{job}-n3"])), b"\xff\x00"]
        send(run.settings, poison, raw=[(DECISIONS.name, job.encode(), g) for g in garbage])
        send(run.settings, valid)
        rec = run.wait(valid.decision_id)
        assert rec.state is RecoveryState.SUCCEEDED and rec.path == "evict"
        dl = dead_letter(dead, "actions:accept", job)
        assert dl.topic == DECISIONS.name and dl.offset >= 0 and poison.decision_id in dl.payload
        assert "ValueError" in dl.reason
        # the garbage, dead-lettered by the consumer, each record once
        decoded = [d for d in dead_letters(dead, job, 4) if d.stage == "decode"]
        assert len(decoded) == 3 and all(d.topic == DECISIONS.name for d in decoded)
        assert len({d.offset for d in decoded} | {dl.offset}) == 4
        assert run.service.store.get(poison.decision_id) is None
        # (the count includes the garbage earlier tests left on the topic: a new group reads it all)
        assert run.thread.is_alive() and run.service.dead_lettered >= 4
        assert [c["args"]["machines"] for c in run.calls("evict", job)] == [[f"{job}-n2"]]
        # committed past every bad record: a restarted service never reads them again
        group = run.service.cfg.consumer_group
        wait_until(
            lambda: committed(run.settings, group, DECISIONS.name, dl.partition) > dl.offset,
            30,
            f"group {group} to commit past {DECISIONS.name}[{dl.partition}]@{dl.offset}",
        )
        where = f"{DECISIONS.name}[{dl.partition}]@{dl.offset}"
        logged = [r for r in caplog.records if "actions:accept" in r.getMessage() and where in r.getMessage()]
        assert [r.levelno for r in logged] == [logging.ERROR]  # logged once, with its coordinates
    finally:
        dead.close()


def test_a_poison_job_spec_is_dead_lettered_and_the_next_one_used(start_service: Start) -> None:
    job = unique("job-badspec")
    run = start_service([job])
    dead = Watcher(run.settings, DEAD_LETTERS)
    poison, valid = job_spec(job, n=2), job_spec(job, n=4)
    real = run.service.store.save_spec

    def save_spec(spec: JobSpec) -> bool:  # decodes, then the store raises
        if spec == poison:
            raise TypeError("a spec the store cannot take")
        return real(spec)

    run.service.store.save_spec = save_spec  # type: ignore[method-assign]
    try:
        raw = [(JOBS.name, job.encode(), b"\xffnot a spec"), (JOBS.name, job.encode(), lone_surrogate(valid))]
        send(run.settings, poison, raw=raw)
        send(run.settings, valid)
        d = make_decision(job, Action.EVICT, [f"{job}-n3"])  # n3 exists only in the valid spec
        send(run.settings, d)
        rec = run.wait(d.decision_id)
        assert rec.state is RecoveryState.SUCCEEDED, rec.detail
        dl = dead_letter(dead, "actions:jobs", job)
        assert dl.topic == JOBS.name and dl.offset >= 0 and encode(poison).decode() == dl.payload
        decoded = [d for d in dead_letters(dead, job, 3) if d.stage == "decode"]
        assert len(decoded) == 2 and all(d.topic == JOBS.name for d in decoded)
        assert run.thread.is_alive() and run.service.dead_lettered >= 3
    finally:
        dead.close()


def test_the_store_down_is_retried_not_dead_lettered(start_service: Start) -> None:
    """A store that is down for one decision and one job spec: both are read again from the
    broker (the readers seek back), none is dead-lettered, nothing is lost."""
    job = unique("job-storedown")
    run = start_service([job])
    dead = Watcher(run.settings, DEAD_LETTERS)
    a, b = make_decision(job, Action.EVICT, [f"{job}-n1"]), make_decision(job, Action.EVICT, [f"{job}-n2"])
    store = run.service.store
    real_accept, real_save = store.accept, store.save_spec
    accepts: list[str] = []
    saves: list[JobSpec] = []

    def accept(decision: Decision, now_ms: int) -> bool:
        accepts.append(decision.decision_id)
        if decision.decision_id == b.decision_id and accepts.count(b.decision_id) == 1:
            raise sqlite3.OperationalError("database is locked")
        return real_accept(decision, now_ms)

    def save_spec(spec: JobSpec) -> bool:
        saves.append(spec)
        if len(saves) == 1:
            raise sqlite3.OperationalError("disk I/O error")
        return real_save(spec)

    store.accept = accept  # type: ignore[method-assign]
    store.save_spec = save_spec  # type: ignore[method-assign]
    try:
        spec = job_spec(job)
        send(run.settings, spec)
        send(run.settings, a, b)
        for d in (a, b):
            rec = run.wait(d.decision_id)
            assert rec.state is RecoveryState.SUCCEEDED, rec.detail
        # the spec read again (the recoveries' own specs, published by the evictions, follow it)
        assert saves[:2] == [spec, spec]
        assert accepts.count(b.decision_id) == 2 and accepts.count(a.decision_id) == 1
        assert dead.all(lambda e: isinstance(e, DeadLetter) and e.key == job, settle_s=1.0) == []
        assert run.thread.is_alive()
    finally:
        dead.close()


def test_a_recovery_that_keeps_crashing_is_failed_and_dead_lettered(
    start_service: Start, actions_watch: Watcher
) -> None:
    job = unique("job-crash")
    run = start_service([job])
    run.service.crash_pause_s = 0.1
    dead = Watcher(run.settings, DEAD_LETTERS)
    d, after = (
        make_decision(job, Action.EVICT, [f"{job}-n1"]),
        make_decision(job, Action.EVICT, [f"{job}-n2"]),
    )
    real = run.service.runner.run

    def crashing(decision_id: str) -> Recovery:
        if decision_id == d.decision_id:
            raise KeyError("a planning bug")
        return real(decision_id)

    run.service.runner.run = crashing  # type: ignore[method-assign]
    try:
        send(run.settings, job_spec(job))
        partition, offset = produce(run.settings, d)
        rec = run.wait(d.decision_id)
        assert rec.state is RecoveryState.FAILED and "crashed 3 times" in rec.detail
        dl = dead_letter(dead, "actions:recover", job)
        assert (dl.topic, dl.partition, dl.offset) == (DECISIONS.name, partition, offset)
        assert d.decision_id in dl.payload and "KeyError" in dl.reason

        def ended(e: Event) -> bool:
            return isinstance(e, ActionEvent) and e.decision_id == d.decision_id and e.step == "recovery"

        end = actions_watch.wait_for(ended)
        assert isinstance(end, ActionEvent) and end.phase is ActionPhase.FAILED
        send(run.settings, after)  # the job's queue moved on
        assert run.wait(after.decision_id).state is RecoveryState.SUCCEEDED
        assert [c["args"]["machines"] for c in run.calls("evict", job)] == [[f"{job}-n2"]]
        mine = dead.all(lambda e: isinstance(e, DeadLetter) and e.key == job, settle_s=0.5)
        assert [getattr(e, "stage", None) for e in mine] == ["actions:recover"] and run.thread.is_alive()
    finally:
        dead.close()


@pytest.fixture
def private_kafka(tmp_path: Path) -> Iterator[tuple[Settings, KafkaServer]]:
    """A broker of this test's own on free ports: stopping it disturbs nobody else."""
    with private_broker(tmp_path / "kafka-home", [DECISIONS, JOBS, DEAD_LETTERS, ACTIONS]) as started:
        yield started


# A private broker started twice (each start allowed 90 s), a commit timing out against it while
# it is down (the request timeout, 15 s) and two recoveries: more than the 300 s default.
@pytest.mark.timeout(600)
def test_the_broker_down_never_stops_the_service(
    private_kafka: tuple[Settings, KafkaServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker goes away between accepting a decision and committing it: the commit fails,
    the loop goes on (never raises), and once the broker is back the decision is read again (a
    no-op redelivery), committed past and acted on, and new decisions are taken again."""
    caplog.set_level(logging.WARNING, logger="trainguard.actions.service")
    settings, server = private_kafka
    job = unique("job-outage")
    cfg = ActionsConfig(
        group_id=unique("tg-actions-test"),
        jobs=[job],
        state_dir=str(tmp_path / "actions"),
        poll_interval_s=0.2,
        spec_wait_s=20,
        min_standbys=1,
    )
    executor = DryRunExecutor(DryRunConfig(), ExecutorEnv(state_dir=tmp_path / "actions" / "executor"))
    service = ActionService(settings, cfg, executor=executor)
    service.start_consuming()
    service.backoff = Backoff(initial_s=0.5, max_s=1.0)  # retry promptly once the broker is back
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    run = Running(service, executor, thread, stop, settings)
    a, b, c = (make_decision(job, Action.EVICT, [f"{job}-n{i}"]) for i in (1, 2, 3))
    real = service.store.accept
    stopped: list[bool] = []

    def accept_then_lose_the_broker(decision: Decision, now_ms: int) -> bool:
        if decision.decision_id == b.decision_id and not stopped:
            stopped.append(server.stop())  # before the service commits past b
        return real(decision, now_ms)

    service.store.accept = accept_then_lose_the_broker  # type: ignore[method-assign]
    try:
        send(settings, job_spec(job))
        send(settings, a)
        assert run.wait(a.decision_id).state is RecoveryState.SUCCEEDED
        partition, offset = produce(settings, b)
        wait_until(
            lambda: any("committing decisions failed" in r.getMessage() for r in caplog.records),
            60,
            lambda: f"the commit past b to fail with the broker down; logged: {caplog.messages[-5:]}",
        )
        assert stopped == [True] and thread.is_alive()
        assert service.store.get(b.decision_id) is not None  # accepted before the broker went
        server.start()
        server.wait_healthy(90)
        wait_until(
            lambda: service.redelivered >= 1,
            90,
            lambda: f"b read again after the broker came back (redelivered {service.redelivered})",
        )
        wait_until(
            lambda: committed(settings, cfg.consumer_group, DECISIONS.name, partition) > offset,
            60,
            f"the group to commit past b ({DECISIONS.name}[{partition}]@{offset})",
        )
        send(settings, c)
        for d in (b, c):
            rec = run.wait(d.decision_id, timeout_s=120)
            assert rec.state is RecoveryState.SUCCEEDED, rec.detail
        assert service.accepted == 3 and service.dead_lettered == 0 and thread.is_alive()
        assert sorted(m for call in run.calls("evict", job) for m in call["args"]["machines"]) == [
            f"{job}-n1",
            f"{job}-n2",
            f"{job}-n3",
        ]
    finally:
        stop.set()
        thread.join(60)


def test_stale_and_future_dated_decisions_and_specs_are_dead_lettered_not_acted_on(
    start_service: Start,
) -> None:
    job = unique("job-dated")
    run = start_service([job], max_decision_age_s=600, clock_skew_s=60)
    dead = Watcher(run.settings, DEAD_LETTERS)
    try:
        future_spec = replace(job_spec(job, n=4), ts_ms=now_ms() + 3_600_000)
        send(run.settings, future_spec)
        spec_dl = dead_letter(dead, "actions:jobs", job)
        assert "in the future" in spec_dl.reason
        send(run.settings, job_spec(job, n=4))
        stale = replace(make_decision(job, Action.EVICT, [f"{job}-n1"]), ts_ms=now_ms() - 7_200_000)
        ahead = replace(make_decision(job, Action.EVICT, [f"{job}-n2"]), ts_ms=now_ms() + 3_600_000)
        fresh = make_decision(job, Action.EVICT, [f"{job}-n3"])
        send(run.settings, stale)
        send(run.settings, ahead)
        send(run.settings, fresh)
        rec = run.wait(fresh.decision_id)
        assert rec.state is RecoveryState.SUCCEEDED
        reasons = sorted(d.reason for d in dead_letters(dead, job, 3) if d.stage == "actions:accept")
        assert len(reasons) == 2
        assert "s old (at most 600 s is acted on)" in reasons[0] + reasons[1]
        assert "in the future" in reasons[0] + reasons[1]
        assert run.service.store.get(stale.decision_id) is None
        assert run.service.store.get(ahead.decision_id) is None
        # the spec that won is the real one, not the one dated an hour ahead
        spec = run.service.store.spec(job)
        assert spec is not None and spec.ts_ms < future_spec.ts_ms
        assert [c["args"]["machines"] for c in run.calls("evict", job)] == [[f"{job}-n3"]]
    finally:
        dead.close()


def test_a_pause_holds_every_recovery_step_until_resumed(start_service: Start) -> None:
    job = unique("job-pause-all")
    run = start_service([job])
    send(run.settings, job_spec(job, n=4))
    run.service.store.pause("maintenance", "test", now_ms())
    d = make_decision(job, Action.EVICT, [f"{job}-n1"])
    send(run.settings, d)
    wait_until(lambda: run.service.store.get(d.decision_id) is not None, 30, "the decision to be accepted")
    time.sleep(2.0)  # several dispatch rounds (poll 0.2 s): none may start the recovery
    rec = run.service.store.get(d.decision_id)
    assert rec is not None and rec.state is RecoveryState.PENDING
    assert run.executor.records() == []
    assert run.service.store.resume()
    rec = run.wait(d.decision_id)
    assert rec.state is RecoveryState.SUCCEEDED and len(run.calls("evict", job)) == 1
