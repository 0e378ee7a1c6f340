"""Drives nodes along their way back: records evictions, validates repaired nodes, returns or
holds them, and keeps every transition in ClickHouse (``node_transitions``).

Each operation is *read the node's history -> ask the state machine* (:mod:`node_states`) *->
change the scheduler -> record*, and each is safe to repeat: the history says what is done, the
scheduler calls look before they change, and a transition recorded twice is one row.  The order
matters where a crash can fall in between: a node is resumed **before** ``returned`` is recorded
(a crash leaves it ``validating``; ``trainguard nodes repaired`` runs it again), and held
**before** ``awaiting_repair`` is recorded.

Where evictions come from (:meth:`NodeReturn.sync`): the action service's ``evict`` steps that
succeeded (``action_events``; by the decision id) and preflights that drained or cordoned a node
(``node_checks``; by the check id).  Each validation is also a ``node_checks`` row (origin
``validation``), so the node's test history is in one place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from trainguard.actions.node_config import NodeReturnConfig
from trainguard.actions.node_states import DAY_MS, NodeEvent, TransitionRefused, apply, state_of
from trainguard.diag.preflight import Verdict, node_check
from trainguard.infra.clickhouse.rows import ts
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.schemas.base import now_ms
from trainguard.schemas.nodes import Cause, NodeState, NodeTransition
from trainguard.schemas.telemetry import CheckAction, CheckOutcome

log = logging.getLogger(__name__)

TABLE = "node_transitions"
_COLUMNS = ("transition_id", "node", "ts_ms", "seq", "from_state", "to_state", "cause", "by", "ref", "detail")


class Scheduler(Protocol):
    """What the way back needs of a scheduler (:class:`~trainguard.actions.node_slurm.SlurmNodes`,
    :class:`~trainguard.actions.node_kubernetes.KubernetesNodes`)."""

    name: str

    def node(self, node: str) -> Any:
        """The node (raises UnknownNode when the scheduler has none)."""

    def validate(self, node: str) -> Verdict:
        """Run the validation on the node; its verdict (the node stays out of general service)."""

    def resume(self, node: str) -> None:
        """Return the node to service."""

    def hold(self, node: str, reason: str) -> None:
        """Keep the node out of service with ``reason``."""


class TransitionStore:
    """``node_transitions`` (and the eviction sources) in ClickHouse."""

    def __init__(self, store: ClickHouseStore) -> None:
        self.store = store

    def history(self, node: str) -> list[NodeTransition]:
        rows = self.store.query(
            f"SELECT {', '.join(_COLUMNS)} FROM {TABLE} FINAL WHERE node = %(node)s ORDER BY ts_ms, seq",
            {"node": node},
        )
        return [_transition(r) for r in rows]

    def latest(self) -> dict[str, list[NodeTransition]]:
        """Every node's history (nodes with a recorded eviction)."""
        rows = self.store.query(f"SELECT {', '.join(_COLUMNS)} FROM {TABLE} FINAL ORDER BY node, ts_ms, seq")
        out: dict[str, list[NodeTransition]] = {}
        for r in rows:
            t = _transition(r)
            out.setdefault(t.node, []).append(t)
        return out

    def record(self, transitions: list[NodeTransition]) -> None:
        self.store.insert_rows(TABLE, [_row(t) for t in transitions])

    def evictions(self, since_ms: int) -> list[tuple[str, int, str, str]]:
        """(node, ts_ms, ref, detail) of every eviction since ``since_ms``, oldest first."""
        decided = self.store.query(
            "SELECT machine, min(ts_ms), decision_id, any(job) FROM action_events FINAL "
            "ARRAY JOIN machines AS machine "
            "WHERE step = 'evict' AND phase = 'succeeded' AND ts_ms >= %(since)s "
            "GROUP BY decision_id, machine",
            {"since": since_ms},
        )
        checked = self.store.query(
            "SELECT node, ts_ms, check_id, reason FROM node_checks FINAL "
            "WHERE action IN ('drained', 'cordoned') AND origin != 'validation' AND ts_ms >= %(since)s",
            {"since": since_ms},
        )
        out = [(str(m), int(ts), str(d), f"evicted from job {job}") for m, ts, d, job in decided]
        out += [(str(n), int(ts), str(c), f"preflight: {reason}") for n, ts, c, reason in checked]
        return sorted(out, key=lambda e: (e[1], e[0], e[2]))


def _row(t: NodeTransition) -> dict[str, Any]:
    row = {c: getattr(t, c) for c in _COLUMNS}
    return {**row, "to_state": t.to_state.value, "cause": t.cause.value, "ts": ts(t.ts_ms)}


def _transition(r: tuple[Any, ...]) -> NodeTransition:
    d = dict(zip(_COLUMNS, r, strict=True))
    return NodeTransition(
        **{
            **d,
            "ts_ms": int(d["ts_ms"]),
            "seq": int(d["seq"]),
            "to_state": NodeState(d["to_state"]),
            "cause": Cause(d["cause"]),
        }
    )


class NodeReturn:
    """The operations behind ``trainguard nodes``; ``clock`` is injectable for tests."""

    def __init__(
        self,
        cfg: NodeReturnConfig,
        transitions: TransitionStore,
        scheduler: Scheduler,
        clock: Callable[[], int] = now_ms,
    ) -> None:
        self.cfg, self.transitions, self.scheduler, self.clock = cfg, transitions, scheduler, clock

    def _apply(self, node: str, event: NodeEvent, ts_ms: int | None = None) -> list[NodeTransition]:
        history = self.transitions.history(node)
        new = apply(node, history, event, self.clock() if ts_ms is None else ts_ms, self.cfg.policy)
        if new:
            self.transitions.record(new)
        return new

    def sync(self, hold: bool = True) -> list[NodeTransition]:
        """Record every eviction not recorded yet; quarantined nodes get the quarantine as their
        scheduler reason (they are drained or cordoned already) unless ``hold`` is False (a
        listing records what happened but changes nothing on the scheduler)."""
        since = self.clock() - int(self.cfg.sync_days * DAY_MS)
        out: list[NodeTransition] = []
        for node, at_ms, ref, detail in self.transitions.evictions(since):
            new = self._apply(node, NodeEvent(Cause.EVICTION, ref, ref, detail), at_ms)
            out += new
            quarantine = next((t for t in new if t.cause is Cause.QUARANTINE), None)
            if quarantine is not None and hold:
                self._hold(node, f"trainguard quarantine: {quarantine.detail}")
        return out

    def repaired(self, node: str, by: str, request: str) -> list[NodeTransition]:
        """An operator says ``node`` is repaired: validate it, then return or hold it."""
        self.scheduler.node(node)  # an unknown node is an error before anything is recorded
        new = self._apply(node, NodeEvent(Cause.REPAIRED, request, by, f"marked repaired by {by}"))
        return new + self.validate(node)

    def validate(self, node: str) -> list[NodeTransition]:
        """Run the validation of a node in ``validating`` and act on its verdict."""
        if state_of(self.transitions.history(node)) is not NodeState.VALIDATING:
            return []
        started = self.clock()
        verdict = self.scheduler.validate(node)
        passed = verdict.outcome is CheckOutcome.PASSED
        action = CheckAction.NONE
        if passed:
            self.scheduler.resume(node)
        else:
            action = CheckAction.DRAINED if self.scheduler.name == "slurm" else CheckAction.CORDONED
            # Held before the record: a hold that fails leaves the node validating (run it again).
            self.scheduler.hold(node, f"trainguard validation: {verdict.reason or verdict.outcome.value}")
        check = node_check(
            verdict,
            node=node,
            origin="validation",
            ts_ms=started,
            action=action,
            policy="drain",
            level=self.cfg.level,
        )
        self.transitions.store.insert_events([check])
        summary = "passed" if passed else f"{verdict.outcome.value}: {verdict.reason}"
        cause = Cause.VALIDATION_PASSED if passed else Cause.VALIDATION_FAILED
        detail = (
            f"diag {self.cfg.level} {summary}; {'resumed' if passed else 'held'} by {self.scheduler.name}"
        )
        return self._apply(node, NodeEvent(cause, check.check_id, check.check_id, detail[:2000]))

    def release(self, node: str, by: str, request: str, reason: str) -> list[NodeTransition]:
        """A person lifts a quarantine: the node waits for repair (then validation) again."""
        self.scheduler.node(node)
        return self._apply(node, NodeEvent(Cause.RELEASED, request, by, reason or f"released by {by}"))

    def _hold(self, node: str, reason: str) -> None:
        try:
            self.scheduler.hold(node, reason)
        except Exception as exc:  # the record stands; an operator sees the warning and the state
            log.warning("could not hold node %s (%s): %s", node, reason, exc)


__all__ = ["NodeReturn", "Scheduler", "TransitionRefused", "TransitionStore"]
