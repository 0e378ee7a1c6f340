"""The state machine of a node's way back into service (issue #39, item 4): pure, no I/O.

:func:`apply` takes a node's recorded history (its :class:`~trainguard.schemas.nodes.NodeTransition`
rows, oldest first), one :class:`NodeEvent` and the time, and returns the transitions to record
-- none when the event was applied already.  Idempotence comes from the history, not from a
flag: an eviction whose decision id is in the history is not counted again, a ``repaired`` of a
node already validating adds nothing (the caller runs the validation again, which is what an
operator repeating the command after a crash wants), a validation result with a known check id
is a no-op.  An event the current state does not allow raises :class:`TransitionRefused`, whose
message says what the operator can do instead.

The quarantine rule, after NVRx's "suspect twice in 14 days": an eviction that brings the node's
evictions within ``window_ms`` (counted since the last release from quarantine, so the person who
released it is not overruled by the evictions they already judged) to ``limit`` quarantines it.
Time is always passed in (``now_ms``, an eviction's own timestamp): tests use plain numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainguard.schemas.control import stable_id
from trainguard.schemas.nodes import Cause, NodeState, NodeTransition

DAY_MS = 86_400_000


class TransitionRefused(ValueError):
    """The event is not allowed in the node's current state (the message says why and what to do)."""


@dataclass(frozen=True)
class QuarantinePolicy:
    """``limit`` evictions within ``window_ms`` quarantine a node (0: never)."""

    limit: int = 2
    window_ms: int = 14 * DAY_MS


@dataclass(frozen=True)
class NodeEvent:
    """Something that happened to a node.

    ``ref`` is what makes it unique (the eviction's decision id, the validation's check id, an
    operator request's id); ``by`` is who or what did it (an operator's name, a decision id, a
    check id); ``detail`` goes into the record as is (a reason line, the diag's finding)."""

    cause: Cause
    ref: str
    by: str
    detail: str = ""


def state_of(history: Sequence[NodeTransition]) -> NodeState | None:
    """The node's current state (None: never evicted, in service)."""
    return history[-1].to_state if history else None


def evictions_counted(history: Sequence[NodeTransition], now_ms: int, window_ms: int) -> int:
    """Evictions within ``window_ms`` before ``now_ms`` and after the last release (distinct refs)."""
    released = max((t.ts_ms for t in history if t.cause is Cause.RELEASED), default=-1)
    start = max(now_ms - window_ms, released + 1)
    return len({t.ref for t in history if t.cause is Cause.EVICTION and start <= t.ts_ms <= now_ms})


def _transition(
    node: str, history: Sequence[NodeTransition], ts_ms: int, offset: int, to: NodeState, event: NodeEvent
) -> NodeTransition:
    prior = state_of(history)
    return NodeTransition(
        transition_id=stable_id("node_transition", node, event.cause.value, event.ref, to.value),
        node=node,
        ts_ms=ts_ms,
        seq=len(history) + offset,
        from_state=prior.value if prior else "",
        to_state=to,
        cause=event.cause,
        by=event.by,
        ref=event.ref,
        detail=event.detail,
    )


def _seen(history: Sequence[NodeTransition], event: NodeEvent) -> bool:
    return any(t.cause is event.cause and t.ref == event.ref for t in history)


def apply(
    node: str,
    history: Sequence[NodeTransition],
    event: NodeEvent,
    now_ms: int,
    policy: QuarantinePolicy = QuarantinePolicy(),
) -> list[NodeTransition]:
    """The transitions ``event`` causes at ``now_ms`` (none when it was applied already).

    >>> once = apply("n1", [], NodeEvent(Cause.EVICTION, "dec-1", "dec-1"), 1_000)
    >>> [(t.from_state, t.to_state.value, t.by) for t in once]
    [('', 'evicted', 'dec-1')]
    >>> apply("n1", once, NodeEvent(Cause.EVICTION, "dec-1", "dec-1"), 1_000)
    []
    >>> twice = apply("n1", once, NodeEvent(Cause.EVICTION, "dec-2", "dec-2"), 2_000)
    >>> [t.to_state.value for t in twice]
    ['evicted', 'quarantined']
    """
    if _seen(history, event):
        return []
    state = state_of(history)
    if event.cause is Cause.EVICTION:
        return _evicted(node, list(history), event, now_ms, policy)
    if event.cause is Cause.REPAIRED:
        if state is NodeState.VALIDATING:
            return []  # repeated while validating: the caller validates again
        if state in (NodeState.EVICTED, NodeState.AWAITING_REPAIR):
            return [_transition(node, history, now_ms, 0, NodeState.VALIDATING, event)]
        raise TransitionRefused(_refusal(node, state, "mark it repaired"))
    if event.cause in (Cause.VALIDATION_PASSED, Cause.VALIDATION_FAILED):
        if state is not NodeState.VALIDATING:
            raise TransitionRefused(_refusal(node, state, "record a validation"))
        to = NodeState.RETURNED if event.cause is Cause.VALIDATION_PASSED else NodeState.AWAITING_REPAIR
        return [_transition(node, history, now_ms, 0, to, event)]
    if event.cause is Cause.RELEASED:
        if state is not NodeState.QUARANTINED:
            raise TransitionRefused(_refusal(node, state, "release it from quarantine"))
        return [_transition(node, history, now_ms, 0, NodeState.AWAITING_REPAIR, event)]
    raise TransitionRefused(f"node {node}: {event.cause.value} is not an event a person or tool may record")


def _evicted(
    node: str, history: list[NodeTransition], event: NodeEvent, ts_ms: int, policy: QuarantinePolicy
) -> list[NodeTransition]:
    state = state_of(history)
    # An eviction from before the node was last marked repaired or released (a late record: it
    # cannot be of the node since, which sat in its validation) or of a node quarantined already
    # is history only: counted for the window, the state stays.  Compared with the repair, not
    # the return: the action service's clock may be a little behind this one's.
    restarted = max((t.ts_ms for t in history if t.cause in (Cause.REPAIRED, Cause.RELEASED)), default=-1)
    late = ts_ms < restarted
    if late or state is NodeState.QUARANTINED:
        keep = state or NodeState.EVICTED
        return [_transition(node, history, ts_ms, 0, keep, event)]
    out = [_transition(node, history, ts_ms, 0, NodeState.EVICTED, event)]
    if policy.limit > 0:
        count = evictions_counted([*history, *out], ts_ms, policy.window_ms)
        if count >= policy.limit:
            days = policy.window_ms / DAY_MS
            why = NodeEvent(
                Cause.QUARANTINE,
                event.ref,
                event.by,
                f"evicted {count} times in {days:g} days (limit {policy.limit}): a person decides",
            )
            out.append(_transition(node, [*history, *out], ts_ms, 0, NodeState.QUARANTINED, why))
    return out


def _refusal(node: str, state: NodeState | None, what: str) -> str:
    if state is None:
        return f"cannot {what}: node {node} has no recorded eviction (run `trainguard nodes sync` first?)"
    hint = {
        NodeState.QUARANTINED: "it is quarantined: a person releases it with `trainguard nodes release`",
        NodeState.RETURNED: "it is back in service",
        NodeState.VALIDATING: "its validation is running (`trainguard nodes repaired` runs it again)",
        NodeState.EVICTED: "it waits for repair (`trainguard nodes repaired`)",
        NodeState.AWAITING_REPAIR: "it waits for repair (`trainguard nodes repaired`)",
    }[state]
    return f"cannot {what}: node {node} is {state.value}; {hint}"
