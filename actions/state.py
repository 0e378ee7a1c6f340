"""The lifecycle of one recovery as an explicit state machine (NVRx rank-monitor style).

A recovery is accepted (``PENDING``), walks through the states of its plan's steps, and ends in
one terminal state.  Every move goes through :func:`check_transition`, so a malformed plan or a
resumed recovery in an impossible state fails loudly instead of acting.

>>> RecoveryState.PENDING.can_become(RecoveryState.STOPPING)
True
>>> check_transition(RecoveryState.SUCCEEDED, RecoveryState.EVICTING)
Traceback (most recent call last):
...
trainguard.actions.state.InvalidStateTransition: recovery cannot go from succeeded to evicting
"""

from __future__ import annotations

from enum import StrEnum


class InvalidStateTransition(RuntimeError):
    """A recovery was asked to move between two states the table does not connect."""

    def __init__(self, current: RecoveryState, new: RecoveryState) -> None:
        super().__init__(f"recovery cannot go from {current.value} to {new.value}")
        self.current, self.new = current, new


class RecoveryState(StrEnum):
    PENDING = "pending"  # accepted and durable; waits for its job's turn
    STOPPING = "stopping"
    DIAGNOSING = "diagnosing"  # stop-time checks (alignment, connectivity)
    REPLAYING = "replaying"  # dual-phase replay
    EVICTING = "evicting"
    SWAPPING = "swapping"  # warm standbys take the evicted machines' places
    UPDATING = "updating"  # hot update / code rollback, in place
    RESTARTING = "restarting"  # from the latest complete checkpoint
    REPLENISHING = "replenishing"  # the job runs again; the standby pool is refilled
    HELD = "held"  # a safety limit waits for an operator
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SUPERSEDED = "superseded"  # merged into another recovery of the same job
    IGNORED = "ignored"  # not the action service's business (aggregate, ignore, none)
    CANCELLED = "cancelled"  # an operator dropped a held recovery

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    def can_become(self, new: RecoveryState) -> bool:
        return new in TRANSITIONS[self]


S = RecoveryState
TERMINAL = frozenset({S.SUCCEEDED, S.FAILED, S.SUPERSEDED, S.IGNORED, S.CANCELLED})
#: states a recovery is in while the service works on it (resumed after a restart).
ACTIVE = frozenset(set(S) - TERMINAL - {S.PENDING, S.HELD})
_END = {S.HELD, S.FAILED}

TRANSITIONS: dict[RecoveryState, frozenset[RecoveryState]] = {
    # A lazy code update queued without a recovery succeeds straight from PENDING.
    S.PENDING: frozenset({S.STOPPING, S.HELD, S.SUCCEEDED, S.SUPERSEDED, S.IGNORED, S.CANCELLED, S.FAILED}),
    # Straight to replaying when the stop-time tests are skipped (none configured).
    S.STOPPING: frozenset({S.DIAGNOSING, S.REPLAYING, S.EVICTING, S.UPDATING, S.RESTARTING, *_END}),
    S.DIAGNOSING: frozenset({S.EVICTING, S.UPDATING, S.RESTARTING, S.REPLAYING, *_END}),
    S.REPLAYING: frozenset({S.EVICTING, *_END}),
    S.EVICTING: frozenset({S.SWAPPING, *_END}),
    S.SWAPPING: frozenset({S.UPDATING, S.RESTARTING, *_END}),
    S.UPDATING: frozenset({S.RESTARTING, *_END}),
    S.RESTARTING: frozenset({S.REPLENISHING, S.SUCCEEDED, *_END}),
    # A failed replenish does not fail the recovery: the job already runs again.
    S.REPLENISHING: frozenset({S.SUCCEEDED}),
    # Released by an operator: the recovery continues where it was held (any step may hold).
    S.HELD: frozenset(
        {
            S.STOPPING,
            S.DIAGNOSING,
            S.REPLAYING,
            S.EVICTING,
            S.SWAPPING,
            S.UPDATING,
            S.RESTARTING,
            S.CANCELLED,
            S.FAILED,
        }
    ),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.SUPERSEDED: frozenset(),
    S.IGNORED: frozenset(),
    S.CANCELLED: frozenset(),
}


def check_transition(current: RecoveryState, new: RecoveryState) -> RecoveryState:
    """``new`` if the table allows ``current -> new`` (staying put is always allowed: a resume)."""
    if new is not current and new not in TRANSITIONS[current]:
        raise InvalidStateTransition(current, new)
    return new
