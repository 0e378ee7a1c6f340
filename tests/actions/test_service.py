"""The action service against the real broker with the dry-run executor (integration, slow)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.actions.conftest import Running, job_spec, make_decision
from tests.streams.harness import Watcher, send, unique
from tests.waiting import wait_until
from trainguard.actions.config import StepPolicy
from trainguard.actions.executors.dry_run import DryRunConfig
from trainguard.actions.state import RecoveryState
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.control import ActionEvent, ActionPhase, JobSpec
from trainguard.schemas.enums import Action

pytestmark = pytest.mark.slow
Start = Callable[..., Running]
FINAL = (ActionPhase.SUCCEEDED, ActionPhase.FAILED)


def events_of(w: Watcher, decision_id: str, settle_s: float = 0.0) -> list[ActionEvent]:
    """The recovery's action events, once its last one (recovery succeeded / failed) is in; then
    ``settle_s`` more seconds in which any further (unwanted) event would show up."""

    def mine(e: Event) -> bool:
        return isinstance(e, ActionEvent) and e.decision_id == decision_id

    def last(e: Event) -> bool:
        return mine(e) and isinstance(e, ActionEvent) and e.step == "recovery" and e.phase in FINAL

    w.wait_for(last)
    return [e for e in w.all(mine, settle_s=settle_s) if isinstance(e, ActionEvent)]


def test_evict_swaps_a_standby_publishes_the_spec_and_ignores_redelivery(
    start_service: Start, actions_watch: Watcher, jobs_watch: Watcher
) -> None:
    job = unique("job-evict")
    spec = job_spec(job, n=4, standbys=2)
    run = start_service([job])
    send(run.settings, spec)
    d = make_decision(job, Action.EVICT, [f"{job}-n2"])
    send(run.settings, d)
    rec = run.wait(d.decision_id)
    assert rec.state is RecoveryState.SUCCEEDED and rec.path == "evict"

    evs = events_of(actions_watch, d.decision_id)
    steps = [(e.step, e.phase.value) for e in evs]
    assert steps == [
        ("recovery", "started"),
        ("stop", "started"),
        ("stop", "succeeded"),
        ("evict", "started"),
        ("evict", "succeeded"),
        ("swap_standbys", "started"),
        ("swap_standbys", "succeeded"),
        ("restart", "started"),
        ("restart", "succeeded"),
        ("replenish", "started"),
        ("replenish", "succeeded"),
        ("recovery", "succeeded"),
    ]
    assert all(e.action is Action.EVICT and e.job == job for e in evs)
    assert evs[-1].duration_ms > 0 and evs[4].targets.machines == [f"{job}-n2"]

    # The workers' topology follows: n2 replaced by the first warm standby, then the pool refilled
    # (P99 rule floored at min_standbys=1: the one standby left already meets it -> no provision).
    swapped = jobs_watch.wait_for(lambda e: isinstance(e, JobSpec) and e.job == job and e.ts_ms > spec.ts_ms)
    assert isinstance(swapped, JobSpec)
    assert swapped.topology.machines == [f"{job}-n0", f"{job}-n1", f"{job}-warm0", f"{job}-n3"]
    assert swapped.standbys == [f"{job}-warm1"]

    # Redelivered (e.g. after a worker restart): no second eviction, no second recovery.
    send(run.settings, d)
    d2 = make_decision(job, Action.EVICT, [f"{job}-n2"])  # a new id for the evicted machine
    send(run.settings, d2)
    assert run.wait(d2.decision_id).state is RecoveryState.SUPERSEDED
    assert len(run.calls("evict", job)) == 1
    assert run.service.redelivered >= 1
    assert [e.step for e in events_of(actions_watch, d.decision_id, 0.2)].count("evict") == 2


def test_blast_radius_cap_holds_until_released(start_service: Start, actions_watch: Watcher) -> None:
    job = unique("job-cap")
    run = start_service([job], max_evictions_per_job_hour=1)
    send(run.settings, job_spec(job, n=4, standbys=1))
    d = make_decision(job, Action.EVICT, [f"{job}-n0", f"{job}-n1"])
    send(run.settings, d)
    rec = run.wait(d.decision_id, states=("held",))
    assert "blast radius" in rec.held_reason and rec.held_step == "evict"
    held = actions_watch.wait_for(lambda e: isinstance(e, ActionEvent) and e.phase is ActionPhase.HELD)
    assert isinstance(held, ActionEvent) and held.decision_id == d.decision_id
    assert run.calls("evict", job) == []

    run.service.store.release(d.decision_id)  # what `trainguard actions release` does
    rec = run.wait(d.decision_id)
    assert rec.state is RecoveryState.SUCCEEDED
    # One standby was warm; the second was provisioned for the shortfall (rescheduled).
    assert len(run.calls("provision_standbys", job)) >= 1
    assert run.calls("evict", job)[0]["args"]["machines"] == [f"{job}-n0", f"{job}-n1"]


def test_restart_budget_stops_a_live_lock(start_service: Start) -> None:
    job = unique("job-budget")
    run = start_service([job], max_restarts=1)
    send(run.settings, job_spec(job))
    first = make_decision(job, Action.RESTART)
    send(run.settings, first)
    assert run.wait(first.decision_id).state is RecoveryState.SUCCEEDED
    second = make_decision(job, Action.RESTART)
    send(run.settings, second)
    rec = run.wait(second.decision_id, states=("held",))
    assert "restart budget" in rec.held_reason
    assert len(run.calls("restart", job)) == 1


def test_user_code_error_rolls_back_in_place(start_service: Start) -> None:
    job = unique("job-rollback")
    run = start_service([job])
    send(run.settings, job_spec(job))
    update = make_decision(
        job, Action.RESTART, code_update={"version": "v2", "urgent": True, "previous": "v1"}
    )
    send(run.settings, update)
    assert run.wait(update.decision_id).path == "update"
    rollback = make_decision(job, Action.ROLLBACK)
    send(run.settings, rollback)
    rec = run.wait(rollback.decision_id)
    assert rec.state is RecoveryState.SUCCEEDED and rec.path == "rollback"
    assert [c["args"]["version"] for c in run.calls("hot_update", job)] == ["v2", "v1"]
    assert run.calls("evict", job) == [] and run.calls("activate_standbys", job) == []  # no rescheduling
    assert run.service.store.version_stack(job) == ["v1"]


def test_lazy_update_waits_for_the_next_recovery_or_is_forced(start_service: Start) -> None:
    job, other = unique("job-lazy"), unique("job-forced")
    run = start_service([job, other], lazy_update_max_wait_s=2)
    send(run.settings, job_spec(job), job_spec(other))
    lazy = make_decision(job, Action.RESTART, code_update={"version": "v7", "previous": "v6"})
    send(run.settings, lazy)
    assert run.wait(lazy.decision_id).path == "queue_update"
    assert run.calls("hot_update", job) == []
    crash = make_decision(job, Action.EVICT, [f"{job}-n1"])
    send(run.settings, crash)
    assert run.wait(crash.decision_id).state is RecoveryState.SUCCEEDED
    assert [c["args"]["version"] for c in run.calls("hot_update", job)] == ["v7"]
    assert run.service.store.version_stack(job) == ["v6", "v7"]

    # No recovery comes for `other`: its update is forced once it waited too long.
    send(run.settings, make_decision(other, Action.RESTART, code_update={"version": "v2"}))
    deadline_calls = wait_until(
        lambda: run.calls("hot_update", other), 10, f"the forced hot update of {other}"
    )
    assert [c["args"]["version"] for c in deadline_calls] == ["v2"]
    forced = [
        r for r in run.service.store.recoveries(other) if r.decision.evidence["code_update"].get("forced")
    ]
    assert len(forced) == 1 and run.wait(forced[0].decision_id).path == "update"


def test_crash_without_culprit_escalates_evict_reattempt_rollback_replay(start_service: Start) -> None:
    job = unique("job-nan")
    machines = [f"{job}-n{i}" for i in range(8)]
    dry = DryRunConfig(failing_tests={"alignment": [machines[3]]}, sdc_machines=[machines[5]])
    run = start_service([job], dry_run=dry, replay_k=1)
    send(run.settings, job_spec(job, n=8, standbys=3, pp=2))

    # 1. alignment flags n3 -> evicted, standby in.
    d1 = make_decision(job, Action.DIAGNOSE)
    send(run.settings, d1)
    rec = run.wait(d1.decision_id)
    assert rec.path == "diagnose_evict"
    assert run.calls("evict", job)[0]["args"]["machines"] == [machines[3]]
    # 2. an operator ships v2; the job crashes again, the tests pass -> roll back to v1.
    run.executor.cfg.failing_tests.clear()
    upd = make_decision(job, Action.RESTART, code_update={"version": "v2", "previous": "v1", "urgent": True})
    send(run.settings, upd)
    run.wait(upd.decision_id)
    d2 = make_decision(job, Action.DIAGNOSE)
    send(run.settings, d2)
    rec = run.wait(d2.decision_id)
    assert rec.path == "rollback"
    assert run.service.store.version_stack(job) == ["v1"]
    # 3. still failing -> dual-phase replay isolates n5 (SDC), which is evicted.
    d3 = make_decision(job, Action.DIAGNOSE)
    send(run.settings, d3)
    rec = run.wait(d3.decision_id)
    assert rec.state is RecoveryState.SUCCEEDED and rec.path == "replay"
    replays = run.calls("run_replay", job)
    assert len(replays) == 2
    assert [c["args"]["machines"] for c in run.calls("evict", job)] == [[machines[3]], [machines[5]]]
    # 4. and again -> nothing automatic is left: an operator decides.
    d4 = make_decision(job, Action.DIAGNOSE)
    send(run.settings, d4)
    rec = run.wait(d4.decision_id, states=("held",))
    assert "dual-phase replay did not keep" in rec.held_reason


def test_diagnose_all_pass_reattempts_and_transient_errors_are_retried(start_service: Start) -> None:
    job = unique("job-reattempt")
    run = start_service([job], dry_run=DryRunConfig(transient_errors={"restart": 2}))
    send(run.settings, job_spec(job))
    d = make_decision(job, Action.DIAGNOSE)
    send(run.settings, d)
    rec = run.wait(d.decision_id)
    assert rec.state is RecoveryState.SUCCEEDED and rec.path == "reattempt"
    restart = next(s for s in run.service.store.steps(d.decision_id) if s["key"] == "restart")
    assert restart["attempts"] == 3 and len(run.calls("restart", job)) == 1
    assert run.calls("evict", job) == []


def test_a_step_that_fails_for_good_holds_the_job_for_an_operator_never_leaves_it_dead(
    start_service: Start, actions_watch: Watcher, caplog: pytest.LogCaptureFixture
) -> None:
    """A permanent error ends in a hold with an ERROR line saying what is needed, not in a
    "failed" recovery that leaves the stopped job dead."""
    job = unique("job-perm")
    run = start_service([job], dry_run=DryRunConfig(permanent_errors=["evict"]))
    send(run.settings, job_spec(job))
    d = make_decision(job, Action.EVICT, [f"{job}-n0"])
    with caplog.at_level("ERROR", logger="trainguard.actions.recovery"):
        send(run.settings, d)
        rec = run.wait(d.decision_id, states=("held",))
    assert rec.held_step == "evict" and "needed: evict (cordon and drain)" in rec.held_reason
    assert f"trainguard actions release {d.decision_id}" in rec.held_reason
    assert any(r.levelname == "ERROR" and d.decision_id in r.getMessage() for r in caplog.records)
    held = actions_watch.wait_for(
        lambda e: (
            isinstance(e, ActionEvent) and e.decision_id == d.decision_id and e.phase is ActionPhase.HELD
        )
    )
    assert isinstance(held, ActionEvent) and held.step == "evict" and "needed:" in held.detail


def test_standbys_that_never_start_hold_the_swap_then_release_resumes_it(
    start_service: Start, actions_watch: Watcher
) -> None:
    """Standbys still starting make ``swap_standbys`` retry within its budget; when the budget is
    spent the recovery is held (the job is not silently dead), and a release after the standbys
    came up swaps them in and restarts the job."""
    job = unique("job-swap-held")
    run = start_service(
        [job],
        dry_run=DryRunConfig(transient_errors={"activate_standbys": 3}),
        steps={"swap_standbys": StepPolicy(retries=1, backoff_s=0.1, budget_s=30)},
    )
    send(run.settings, job_spec(job, n=4, standbys=2))
    d = make_decision(job, Action.EVICT, [f"{job}-n1"])
    send(run.settings, d)
    rec = run.wait(d.decision_id, states=("held",))
    assert rec.held_step == "swap_standbys" and "needed: ready standby machines" in rec.held_reason
    assert run.calls("restart", job) == []
    run.service.store.release(d.decision_id)
    rec = run.wait(d.decision_id)
    assert rec.state is RecoveryState.SUCCEEDED and rec.path == "evict"
    assert len(run.calls("restart", job)) == 1
    swap = next(s for s in run.service.store.steps(d.decision_id) if s["key"] == "swap_standbys")
    assert swap["attempts"] == 4  # 2 before the hold, 2 after the release (the third error, then ok)


def test_hang_localised_during_a_recovery_is_that_recovery_not_a_new_fault(start_service: Start) -> None:
    job = unique("job-pause")
    run = start_service([job], dry_run=DryRunConfig(delays={"run_diagnostics": 3.0}))
    send(run.settings, job_spec(job))
    machines = [f"{job}-n{i}" for i in range(4)]
    crash = make_decision(job, Action.DIAGNOSE)
    send(run.settings, crash)
    # While the job is stopped for diagnostics, the stall detector sees no steps and the stacks
    # point somewhere; an Xid from a machine in the same seconds is a real fault all the same.
    stalled = make_decision(
        job, Action.EVICT, [machines[1]], detection={"kind": "over_eviction", "source_ts_ms": now_ms()}
    )
    xid = make_decision(
        job, Action.EVICT, [machines[2]], detection={"kind": "xid-79", "source_ts_ms": now_ms()}
    )
    run.wait(crash.decision_id, states=("diagnosing",))  # both arrive while the diagnose recovery runs
    send(run.settings, stalled)
    send(run.settings, xid)
    assert run.wait(crash.decision_id).path == "reattempt"
    assert run.wait(stalled.decision_id).state is RecoveryState.SUPERSEDED
    assert run.wait(xid.decision_id).path == "evict"
    assert [c["args"]["machines"] for c in run.calls("evict", job)] == [[machines[2]]]
