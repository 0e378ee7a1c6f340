"""Pure tests: the recovery state machine and the decision -> plan mapping (no servers)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainguard.actions.plans import STATE_OF, Escalation, Plan, PlanContext, StepKind, build_plan
from trainguard.actions.state import TRANSITIONS, InvalidStateTransition, RecoveryState, check_transition
from trainguard.schemas.control import Decision, Targets
from trainguard.schemas.enums import Action

MACHINES = tuple(f"n{i}" for i in range(8))


def decision(action: Action, machines: list[str] | None = None, **evidence: object) -> Decision:
    return Decision(
        decision_id=f"d-{action.value}",
        ts_ms=1,
        job="j",
        action=action,
        targets=Targets(machines=machines or [], group_kind="machine"),
        evidence=dict(evidence),
    )


def keys(plan: Plan) -> list[str]:
    return [s.key for s in plan.steps]


def state_path(plan: Plan) -> list[RecoveryState]:
    """The states the plan walks through (the runner moves to each step's state)."""
    out: list[RecoveryState] = []
    for step in plan.steps:
        st = STATE_OF[step.kind]
        if not out or out[-1] is not st:
            out.append(st)
    return out


def walk(plan: Plan) -> None:
    """Every plan must be a legal walk through the state table, ending in succeeded."""
    state = RecoveryState.PENDING
    for s in state_path(plan):
        state = check_transition(state, s)
    check_transition(state, RecoveryState.SUCCEEDED)


def test_terminal_states_have_no_exit_and_bad_moves_raise() -> None:
    for s in RecoveryState:
        assert (not TRANSITIONS[s]) == s.terminal
    with pytest.raises(InvalidStateTransition, match="from pending to swapping"):
        check_transition(RecoveryState.PENDING, RecoveryState.SWAPPING)
    with pytest.raises(InvalidStateTransition):
        check_transition(RecoveryState.RESTARTING, RecoveryState.EVICTING)
    assert check_transition(RecoveryState.EVICTING, RecoveryState.EVICTING) is RecoveryState.EVICTING
    assert RecoveryState.HELD.can_become(RecoveryState.EVICTING)
    assert not RecoveryState.REPLENISHING.can_become(RecoveryState.FAILED)


def test_evict_plan_swaps_standbys_and_drops_machines_no_longer_in_the_job() -> None:
    ctx = PlanContext(machines=MACHINES)
    plan = build_plan(decision(Action.EVICT, ["n3", "gone"]), ctx, {})
    assert keys(plan) == ["stop", "evict", "swap_standbys", "restart", "replenish"]
    assert plan.steps[1].machines == ("n3",) and plan.next_level == Escalation.ROLLBACK
    walk(plan)
    assert build_plan(decision(Action.EVICT, ["gone"]), ctx, {}).path == "superseded"


def test_lazy_update_rides_along_but_not_with_a_rollback() -> None:
    ctx = PlanContext(machines=MACHINES, pending_update="v3", rollback_target="v1")
    evict = build_plan(decision(Action.EVICT, ["n1"]), ctx, {})
    assert keys(evict) == ["stop", "evict", "swap_standbys", "hot_update", "restart", "replenish"]
    assert evict.steps[3].version == "v3"
    walk(evict)
    rollback = build_plan(decision(Action.ROLLBACK), ctx, {})
    assert keys(rollback) == ["stop", "hot_update", "restart"]
    assert rollback.steps[1].version == "v1" and rollback.steps[1].note == "rollback"
    walk(rollback)


def test_rollback_without_history_restarts_in_place_and_says_why() -> None:
    plan = build_plan(decision(Action.ROLLBACK), PlanContext(machines=MACHINES), {})
    assert not plan.hold and keys(plan) == ["stop", "restart"]
    assert plan.skipped == (("rollback", "no earlier code version is recorded for this job to roll back to"),)
    assert plan.path == "rollback" and plan.next_level == Escalation.REPLAY
    walk(plan)
    # An executor that cannot switch versions cannot roll back either.
    ctx = PlanContext(machines=MACHINES, rollback_target="v1", unconfigured={"hot_update": "no command"})
    cannot = build_plan(decision(Action.ROLLBACK), ctx, {})
    assert keys(cannot) == ["stop", "restart"]
    assert cannot.skipped == (("rollback", "the executor cannot hot_update: no command"),)


def test_code_updates_urgent_now_lazy_queued() -> None:
    ctx = PlanContext(machines=MACHINES)
    urgent = build_plan(decision(Action.RESTART, code_update={"version": "v2", "urgent": True}), ctx, {})
    assert keys(urgent) == ["stop", "hot_update", "restart"] and urgent.path == "update"
    lazy = build_plan(decision(Action.RESTART, code_update={"version": "v2"}), ctx, {})
    assert keys(lazy) == ["queue_update"] and lazy.next_level is None
    walk(urgent)
    walk(lazy)
    assert keys(build_plan(decision(Action.RESTART), ctx, {})) == ["stop", "restart"]


def test_aggregate_and_ignore_are_not_the_services_business() -> None:
    for action in (Action.AGGREGATE, Action.IGNORE, Action.NONE):
        assert build_plan(decision(action), PlanContext(machines=MACHINES), {}).path == "ignored"


def test_diagnose_branches_on_results_and_escalation_level() -> None:
    ctx = PlanContext(machines=MACHINES, rollback_target="v1")
    first = build_plan(decision(Action.DIAGNOSE), ctx, {})
    assert keys(first) == ["stop", "diagnose"] and not first.complete
    assert first.steps[1].tests == ("alignment", "connectivity")

    failed = build_plan(decision(Action.DIAGNOSE), ctx, {"stop": {}, "diagnose": {"failed": ["n5"]}})
    assert failed.path == "diagnose_evict" and failed.steps[2].machines == ("n5",)
    walk(failed)

    passed: dict[str, Any] = {"stop": {}, "diagnose": {"failed": []}}
    reattempt = build_plan(decision(Action.DIAGNOSE), ctx, passed)
    assert reattempt.path == "reattempt" and keys(reattempt)[-1] == "restart"
    walk(reattempt)
    rollback = build_plan(decision(Action.DIAGNOSE), PlanContext(**{**ctx.__dict__, "level": 1}), passed)
    assert rollback.path == "rollback" and rollback.steps[2].version == "v1"
    walk(rollback)
    operator = build_plan(decision(Action.DIAGNOSE), PlanContext(**{**ctx.__dict__, "level": 3}), passed)
    assert operator.hold


def test_diagnose_skips_rollback_without_code_history_and_replays() -> None:
    # 8 machines, PP=2: m = 2, n = 4 -> horizontal {0,1},{2,3},..; vertical {0,4},{1,5},..
    ctx = PlanContext(machines=MACHINES, pp=2, level=Escalation.ROLLBACK)
    passed: dict[str, Any] = {"stop": {}, "diagnose": {"failed": []}}
    plan = build_plan(decision(Action.DIAGNOSE), ctx, passed)
    assert plan.path == "replay" and not plan.complete
    assert plan.steps[2].groups[2] == ("n4", "n5") and plan.steps[3].groups[1] == ("n1", "n5")
    # n5 is faulty: horizontal group 2 and vertical group 1 fail
    h = {"ok": [True, True, False, True]}
    v = {"ok": [True, False, True, True]}
    done = build_plan(
        decision(Action.DIAGNOSE), ctx, {**passed, "replay_horizontal": h, "replay_vertical": v}
    )
    assert done.detail["faulty"] == "n5"
    assert [s.machines for s in done.steps if s.kind is StepKind.EVICT] == [("n5",)]
    walk(done)
    ambiguous = build_plan(
        decision(Action.DIAGNOSE),
        ctx,
        {**passed, "replay_horizontal": {"ok": [True] * 4}, "replay_vertical": v},
    )
    assert "did not isolate" in ambiguous.hold


def test_replay_impossible_layout_restarts_instead_of_holding() -> None:
    ctx = PlanContext(machines=MACHINES[:3], pp=2, level=Escalation.REPLAY)
    plan = build_plan(decision(Action.DIAGNOSE), ctx, {"stop": {}, "diagnose": {"failed": []}})
    assert not plan.hold and keys(plan) == ["stop", "diagnose", "restart"]
    [(rung, why)] = plan.skipped
    assert rung == "replay" and why.startswith("dual-phase replay impossible: 3 machines")
    walk(plan)


def test_replay_without_a_replay_command_restarts_and_the_next_crash_goes_to_an_operator() -> None:
    """The documented Slurm config has no replay_command: the replay rung is skipped, not held."""
    gaps = {"run_replay": "executor_options.replay_command is empty"}
    ctx = PlanContext(
        machines=MACHINES, pp=2, level=Escalation.ROLLBACK, unconfigured=gaps, pending_update="v9"
    )
    passed: dict[str, Any] = {"stop": {}, "diagnose": {"failed": []}}
    plan = build_plan(decision(Action.DIAGNOSE), ctx, passed)
    # no code history -> rollback skipped -> replay skipped -> restart (no new code, as a replay's)
    assert not plan.hold and plan.complete and keys(plan) == ["stop", "diagnose", "restart"]
    assert plan.skipped == (
        ("rollback", "no earlier code version is recorded for this job to roll back to"),
        ("replay", "the executor cannot run_replay: executor_options.replay_command is empty"),
    )
    assert plan.path == "replay" and plan.next_level == Escalation.OPERATOR
    assert not [s for s in plan.steps if s.kind in (StepKind.REPLAY_HORIZONTAL, StepKind.REPLAY_VERTICAL)]
    walk(plan)
    # With the command, the same context replays.
    configured = PlanContext(**{**ctx.__dict__, "unconfigured": {}})
    assert keys(build_plan(decision(Action.DIAGNOSE), configured, passed))[2:] == [
        "replay_horizontal",
        "replay_vertical",
    ]


def test_diagnose_without_stop_time_tests_skips_to_the_escalation_rung() -> None:
    for ctx, why in (
        (PlanContext(machines=MACHINES, tests=()), "no stop-time tests are configured"),
        (
            PlanContext(machines=MACHINES, unconfigured={"run_diagnostics": "no commands"}),
            "the executor cannot run_diagnostics: no commands",
        ),
    ):
        plan = build_plan(decision(Action.DIAGNOSE), ctx, {})
        assert keys(plan) == ["stop", "restart"] and plan.path == "reattempt" and plan.complete
        assert plan.skipped == (("diagnose", why),)
        walk(plan)


def test_plan_context_round_trips_and_reads_contexts_stored_before_skipping() -> None:
    ctx = PlanContext(machines=MACHINES, unconfigured={"run_replay": "no command"})
    assert PlanContext.from_json(ctx.to_json()) == ctx
    old = {k: v for k, v in ctx.to_json().items() if k != "unconfigured"}
    assert PlanContext.from_json(old).unconfigured == {}


@given(
    action=st.sampled_from(list(Action)),
    level=st.integers(0, 4),
    failed=st.lists(st.sampled_from(MACHINES), max_size=3, unique=True),
    pending=st.sampled_from(["", "v9"]),
    target=st.sampled_from(["", "v0"]),
    sdc=st.integers(0, 7),
    gaps=st.sampled_from([{}, {"run_replay": "x"}, {"run_diagnostics": "x", "hot_update": "y"}]),
)
def test_every_plan_is_a_legal_state_walk(
    action: Action, level: int, failed: list[str], pending: str, target: str, sdc: int, gaps: dict[str, str]
) -> None:
    ctx = PlanContext(
        machines=MACHINES,
        pp=2,
        level=level,
        pending_update=pending,
        rollback_target=target,
        unconfigured=gaps,
    )
    d = decision(action, ["n2"], code_update={"version": "v5", "urgent": level % 2 == 0})
    results: dict[str, object] = {"stop": {}, "diagnose": {"failed": failed}}
    results["replay_horizontal"] = {"ok": [g != sdc // 2 for g in range(4)]}
    results["replay_vertical"] = {"ok": [g != sdc % 4 for g in range(4)]}
    plan = build_plan(d, ctx, results)
    if not plan.hold:
        walk(plan)
        assert plan.complete
        assert len({s.key for s in plan.steps}) == len(plan.steps)  # keys identify steps
    # a skipped rung never runs, and its record never collides with a step's
    assert not {r for r, _ in plan.skipped} & {s.key for s in plan.steps}
