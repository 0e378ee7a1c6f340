"""The action service against the real broker moves past bad decisions and job specs
(integration, slow).

What makes a record bad here is the store refusing it (patched on the running service: the
decoder now rejects the natural examples, a lone surrogate or a 4,301-digit integer, before the
store sees them); garbage on the wire rides along and must be dead-lettered too.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from actions.state import RecoveryState
from schemas.base import Event
from schemas.codec import encode
from schemas.control import DeadLetter, Decision, JobSpec
from schemas.enums import Action
from schemas.topics import DEAD_LETTERS, DECISIONS, JOBS
from tests.actions.conftest import Running, job_spec, make_decision
from tests.streams.harness import Watcher, send, unique

pytestmark = pytest.mark.slow
Start = Callable[..., Running]
HUGE = b'{"schema":"decision","version":1,"n":' + b"1" * 4301 + b"}"


def dead_letter(w: Watcher, stage: str, key: str) -> DeadLetter:
    def mine(e: Event) -> bool:
        return isinstance(e, DeadLetter) and e.stage == stage and e.key == key

    found = w.wait_for(mine)
    assert isinstance(found, DeadLetter)
    return found


def test_a_poison_decision_is_dead_lettered_and_the_next_one_acted_on(start_service: Start) -> None:
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
        send(run.settings, poison, raw=[(DECISIONS.name, job.encode(), HUGE)])
        send(run.settings, valid)
        rec = run.wait(valid.decision_id)
        assert rec.state is RecoveryState.SUCCEEDED and rec.path == "evict"
        dl = dead_letter(dead, "actions:accept", job)
        assert dl.topic == DECISIONS.name and dl.offset >= 0 and poison.decision_id in dl.payload
        assert "ValueError" in dl.reason
        assert dead_letter(dead, "decode", job).topic == DECISIONS.name  # the garbage, by the consumer
        assert run.service.store.get(poison.decision_id) is None
        assert run.thread.is_alive() and run.service.dead_lettered >= 2
        assert [c["args"]["machines"] for c in run.calls("evict", job)] == [[f"{job}-n2"]]
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
        send(run.settings, poison, raw=[(JOBS.name, job.encode(), b"\xffnot a spec")])
        send(run.settings, valid)
        d = make_decision(job, Action.EVICT, [f"{job}-n3"])  # n3 exists only in the valid spec
        send(run.settings, d)
        rec = run.wait(d.decision_id)
        assert rec.state is RecoveryState.SUCCEEDED, rec.detail
        dl = dead_letter(dead, "actions:jobs", job)
        assert dl.topic == JOBS.name and dl.offset >= 0 and encode(poison).decode() == dl.payload
        assert dead_letter(dead, "decode", job).topic == JOBS.name
        assert run.thread.is_alive()
    finally:
        dead.close()
