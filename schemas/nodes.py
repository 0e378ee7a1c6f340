"""A node's way back into service after an eviction: its states and the record of each change.

Every node TrainGuard takes out (an eviction decision drains or cordons it, a preflight fails it)
has a state, stored as the latest of its :class:`NodeTransition` rows in ClickHouse
(``node_transitions``, migration 0010).  The states and what moves a node between them::

    (in service) --eviction--> evicted --repaired--> validating --diag passed--> returned
                                  |                      |
                                  |                      +--diag failed--> awaiting_repair
                                  |                                        (--repaired--> validating)
                                  +--(N evictions in the window)--> quarantined
                                                                    (--released--> awaiting_repair)

The machine itself is :mod:`trainguard.actions.node_states` (pure); this module is only the record,
so the CLI, the report and the named query share one spelling of every state and cause.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from trainguard.schemas.names import NODE


class NodeState(StrEnum):
    """Where a node is on its way back (a node with no row is simply in service)."""

    EVICTED = "evicted"  # taken out by an eviction decision or a failed preflight
    AWAITING_REPAIR = "awaiting_repair"  # its validation failed, or a person released a quarantine
    VALIDATING = "validating"  # marked repaired; the standard diag level runs on it now
    RETURNED = "returned"  # passed validation and resumed / uncordoned
    QUARANTINED = "quarantined"  # evicted too often: a person decides, no automatic return


class Cause(StrEnum):
    """What moved a node (the ``cause`` column); ``by`` names who or what exactly."""

    EVICTION = "eviction"  # by: the decision id (or the preflight check id)
    QUARANTINE = "quarantine"  # by: the eviction that crossed the limit
    REPAIRED = "repaired"  # by: the operator
    VALIDATION_PASSED = "validation_passed"  # by: the diag check id
    VALIDATION_FAILED = "validation_failed"  # by: the diag check id
    RELEASED = "released"  # by: the person who lifted a quarantine


@dataclass(frozen=True)
class NodeTransition:
    """One change of a node's state (or, when ``from_state == to_state``, an event recorded in its
    history without a change: an eviction of a node already out).

    ``transition_id`` is a function of the node, the cause and ``ref`` (the decision, check or
    request behind it), so recording the same transition twice -- a command run again, a crash
    between the scheduler change and the insert -- is one row (ReplacingMergeTree).  ``seq``
    orders transitions of one node that share a millisecond (an eviction and the quarantine it
    causes)."""

    transition_id: str
    node: str
    ts_ms: int
    seq: int
    from_state: str  # "" for a node seen for the first time
    to_state: NodeState
    cause: Cause
    by: str
    ref: str = ""
    detail: str = ""

    def __post_init__(self) -> None:
        NODE.check(self.node)
