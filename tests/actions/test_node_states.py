"""The state machine of a node's way back (issue #39, item 4): each transition, idempotence, the
quarantine rule with the time passed in, and refusals that say what to do."""

from __future__ import annotations

import pytest

from trainguard.actions.node_states import (
    DAY_MS,
    NodeEvent,
    QuarantinePolicy,
    TransitionRefused,
    apply,
    evictions_counted,
    state_of,
)
from trainguard.schemas.nodes import Cause, NodeState, NodeTransition

T0 = 1_795_000_000_000
POLICY = QuarantinePolicy(limit=2, window_ms=14 * DAY_MS)


def run(events: list[tuple[NodeEvent, int]], node: str = "n1") -> list[NodeTransition]:
    history: list[NodeTransition] = []
    for event, at in events:
        history += apply(node, history, event, at, POLICY)
    return history


def evicted(ref: str, at: int) -> tuple[NodeEvent, int]:
    return NodeEvent(Cause.EVICTION, ref, ref, "evicted from job llm"), at


def repaired(at: int, by: str = "alice") -> tuple[NodeEvent, int]:
    return NodeEvent(Cause.REPAIRED, f"req-{at}", by), at


def passed(check: str, at: int) -> tuple[NodeEvent, int]:
    return NodeEvent(Cause.VALIDATION_PASSED, check, check, "diag standard passed"), at


def failed(check: str, at: int) -> tuple[NodeEvent, int]:
    return NodeEvent(Cause.VALIDATION_FAILED, check, check, "memory: 3 bad words"), at


def test_the_way_back_after_one_eviction() -> None:
    h = run([evicted("dec-1", T0), repaired(T0 + 1000), passed("chk-1", T0 + 2000)])
    assert [(t.from_state, t.to_state, t.cause, t.by) for t in h] == [
        ("", NodeState.EVICTED, Cause.EVICTION, "dec-1"),
        ("evicted", NodeState.VALIDATING, Cause.REPAIRED, "alice"),
        ("validating", NodeState.RETURNED, Cause.VALIDATION_PASSED, "chk-1"),
    ]
    assert [t.seq for t in h] == [0, 1, 2] and state_of(h) is NodeState.RETURNED
    assert len({t.transition_id for t in h}) == 3


def test_a_failed_validation_waits_for_repair_then_validates_again() -> None:
    h = run([evicted("dec-1", T0), repaired(T0 + 1), failed("chk-1", T0 + 2)])
    assert state_of(h) is NodeState.AWAITING_REPAIR
    assert h[-1].detail == "memory: 3 bad words" and h[-1].by == "chk-1"
    h += apply("n1", h, *repaired(T0 + 3, by="bob"), POLICY)
    assert (h[-1].to_state, h[-1].by) == (NodeState.VALIDATING, "bob")
    h += apply("n1", h, *passed("chk-2", T0 + 4), POLICY)
    assert state_of(h) is NodeState.RETURNED


def test_every_event_applied_twice_is_recorded_once() -> None:
    h = run([evicted("dec-1", T0), repaired(T0 + 1)])
    assert apply("n1", h, *evicted("dec-1", T0), POLICY) == []
    # repaired again while validating: nothing new, the caller validates again
    assert apply("n1", h, *repaired(T0 + 5), POLICY) == []
    h += apply("n1", h, *passed("chk-1", T0 + 6), POLICY)
    assert apply("n1", h, *passed("chk-1", T0 + 6), POLICY) == []
    # the same transition computed twice has the same id (one ReplacingMergeTree row)
    again = apply("n1", h[:2], *passed("chk-1", T0 + 6), POLICY)
    assert again[0].transition_id == h[-1].transition_id


def test_a_second_eviction_within_the_window_quarantines() -> None:
    h = run([evicted("dec-1", T0), repaired(T0 + 1), passed("chk-1", T0 + 2)])
    later = T0 + 13 * DAY_MS
    new = apply("n1", h, *evicted("dec-2", later), POLICY)
    assert [(t.to_state, t.cause, t.by) for t in new] == [
        (NodeState.EVICTED, Cause.EVICTION, "dec-2"),
        (NodeState.QUARANTINED, Cause.QUARANTINE, "dec-2"),
    ]
    assert new[1].detail == "evicted 2 times in 14 days (limit 2): a person decides"
    assert [t.seq for t in new] == [3, 4] and new[0].ts_ms == new[1].ts_ms == later
    h += new
    with pytest.raises(
        TransitionRefused, match="quarantined: a person releases it with `trainguard nodes release`"
    ):
        apply("n1", h, *repaired(later + 1), POLICY)


def test_a_second_eviction_after_the_window_does_not_quarantine() -> None:
    h = run([evicted("dec-1", T0), repaired(T0 + 1), passed("chk-1", T0 + 2)])
    new = apply("n1", h, *evicted("dec-2", T0 + 15 * DAY_MS), POLICY)
    assert [t.to_state for t in new] == [NodeState.EVICTED]
    assert evictions_counted([*h, *new], T0 + 15 * DAY_MS, POLICY.window_ms) == 1


def test_the_window_and_count_are_settings() -> None:
    three_in_a_day = QuarantinePolicy(limit=3, window_ms=DAY_MS)
    h: list[NodeTransition] = []
    for i, ref in enumerate(["d1", "d2", "d3"]):
        at = T0 + i * 3_600_000
        h += apply("n1", h, *evicted(ref, at), three_in_a_day)
        if i < 2:
            h += apply("n1", h, *repaired(at + 1), three_in_a_day)
            h += apply("n1", h, *passed(f"c{i}", at + 2), three_in_a_day)
    assert [t.to_state for t in h[-2:]] == [NodeState.EVICTED, NodeState.QUARANTINED]
    never = QuarantinePolicy(limit=0)
    h2 = run([evicted("d1", T0), repaired(T0 + 1), passed("c1", T0 + 2)])
    assert [t.to_state for t in apply("n1", h2, *evicted("d2", T0 + 3), never)] == [NodeState.EVICTED]


def test_release_lifts_a_quarantine_and_resets_the_count() -> None:
    h = run([evicted("d1", T0), repaired(T0 + 1), passed("c1", T0 + 2), evicted("d2", T0 + 3)])
    assert state_of(h) is NodeState.QUARANTINED
    h += apply("n1", h, NodeEvent(Cause.RELEASED, "rel-1", "carol", "PSU replaced"), T0 + 4, POLICY)
    assert (h[-1].from_state, h[-1].to_state, h[-1].by) == ("quarantined", NodeState.AWAITING_REPAIR, "carol")
    h += apply("n1", h, *repaired(T0 + 5), POLICY)
    h += apply("n1", h, *passed("c2", T0 + 6), POLICY)
    # the evictions the person judged do not count again: one more is not a quarantine yet
    assert [t.to_state for t in apply("n1", h, *evicted("d3", T0 + 7), POLICY)] == [NodeState.EVICTED]


def test_evictions_of_a_node_out_of_service_are_history_only() -> None:
    h = run([evicted("d1", T0), repaired(T0 + 1), passed("c1", T0 + 2), evicted("d2", T0 + 3)])
    # quarantined already: the third eviction is counted, the state stays
    new = apply("n1", h, *evicted("d3", T0 + 4), POLICY)
    assert [(t.from_state, t.to_state) for t in new] == [("quarantined", NodeState.QUARANTINED)]
    # a late record (from before the repair) does not pull a returned node out
    h2 = run([evicted("d1", T0), repaired(T0 + 10), passed("c1", T0 + 20)])
    late = apply("n1", h2, *evicted("d0", T0 + 5), POLICY)
    assert [(t.from_state, t.to_state) for t in late] == [("returned", NodeState.RETURNED)]
    # one stamped a little before the return (the service's clock behind) is a new eviction
    skewed = apply("n1", h2, *evicted("d2", T0 + 15), QuarantinePolicy(limit=0))
    assert [(t.from_state, t.to_state) for t in skewed] == [("returned", NodeState.EVICTED)]


@pytest.mark.parametrize(
    ("events", "event", "message"),
    [
        ([], repaired(T0), "node n1 has no recorded eviction"),
        ([evicted("d1", T0), repaired(T0 + 1), passed("c1", T0 + 2)], repaired(T0 + 3), "is back in service"),
        ([evicted("d1", T0)], passed("c1", T0 + 1), "cannot record a validation: node n1 is evicted"),
        (
            [evicted("d1", T0)],
            (NodeEvent(Cause.RELEASED, "r", "x"), T0 + 1),
            "cannot release it from quarantine",
        ),
        (
            [evicted("d1", T0)],
            (NodeEvent(Cause.QUARANTINE, "q", "x"), T0 + 1),
            "not an event a person or tool",
        ),
    ],
)
def test_events_the_state_does_not_allow_are_refused(
    events: list[tuple[NodeEvent, int]], event: tuple[NodeEvent, int], message: str
) -> None:
    with pytest.raises(TransitionRefused, match=message):
        apply("n1", run(events), *event, POLICY)


@pytest.mark.parametrize("name", ["../etc", "-rf", "n1;reboot", "", "a" * 254])
def test_hostile_node_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="name"):
        apply(name, [], *evicted("d1", T0), POLICY)
