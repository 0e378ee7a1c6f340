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


def test_rollback_without_history_holds_for_an_operator() -> None:
    plan = build_plan(decision(Action.ROLLBACK), PlanContext(machines=MACHINES), {})
    assert plan.hold and not plan.steps


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


def test_replay_impossible_layout_holds() -> None:
    ctx = PlanContext(machines=MACHINES[:3], pp=2, level=Escalation.REPLAY)
    plan = build_plan(decision(Action.DIAGNOSE), ctx, {"stop": {}, "diagnose": {"failed": []}})
    assert "impossible" in plan.hold


@given(
    action=st.sampled_from(list(Action)),
    level=st.integers(0, 4),
    failed=st.lists(st.sampled_from(MACHINES), max_size=3, unique=True),
    pending=st.sampled_from(["", "v9"]),
    target=st.sampled_from(["", "v0"]),
    sdc=st.integers(0, 7),
)
def test_every_plan_is_a_legal_state_walk(
    action: Action, level: int, failed: list[str], pending: str, target: str, sdc: int
) -> None:
    ctx = PlanContext(machines=MACHINES, pp=2, level=level, pending_update=pending, rollback_target=target)
    d = decision(action, ["n2"], code_update={"version": "v5", "urgent": level % 2 == 0})
    results: dict[str, object] = {"stop": {}, "diagnose": {"failed": failed}}
    results["replay_horizontal"] = {"ok": [g != sdc // 2 for g in range(4)]}
    results["replay_vertical"] = {"ok": [g != sdc % 4 for g in range(4)]}
    plan = build_plan(d, ctx, results)
    if not plan.hold:
        walk(plan)
        assert plan.complete
        assert len({s.key for s in plan.steps}) == len(plan.steps)  # keys identify steps
