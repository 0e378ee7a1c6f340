"""Safety limits: the blast-radius guard on evictions, the circuit breaker and the restart budget.

All three read the durable records of the progress store, so they hold across service restarts.
A limit that would be exceeded *holds* the recovery for an operator (``trainguard actions
release``) rather than failing it: a burst of evictions is more often a detector or network
problem than many bad machines, and a job that crashes on every restart is live-locked, not
recovering.

The blast-radius caps count machines, whatever asked for them.  The circuit breaker counts
*causes*: one detection (the same kind and category) asking to evict most of a job's machines
at once -- five NIC-down reports in 0.2 s from a detector misreading every node's virtual
interfaces -- says more about the detector or the environment than about the machines.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from trainguard.actions.config import ActionsConfig
from trainguard.actions.progress import ProgressStore, Recovery
from trainguard.schemas.control import Decision
from trainguard.schemas.enums import Action

HOUR_MS = 3600 * 1000
#: at most this many machines and decisions are named in a hold's reason (the counts are exact).
_NAMED = 20


def eviction_hold(
    cfg: ActionsConfig, store: ProgressStore, decision_id: str, job: str, machines: list[str], now_ms: int
) -> str:
    """Why evicting ``machines`` of ``job`` now must wait for an operator ("" when it may go).

    Checked and recorded atomically (:meth:`ProgressStore.reserve_evictions`): recoveries of
    several jobs checking at once cannot all pass a cap that only one of them fits under."""

    def refuse(per_job: int, total: int) -> str:
        if per_job > cfg.max_evictions_per_job_hour:
            return (
                f"blast radius: evicting {len(machines)} machine(s) would make {per_job} evictions of job "
                f"{job} in the last hour (cap {cfg.max_evictions_per_job_hour})"
            )
        if total > cfg.max_evictions_per_hour:
            return (
                f"blast radius: evicting {len(machines)} machine(s) would make {total} evictions in the "
                f"last hour across all jobs (cap {cfg.max_evictions_per_hour})"
            )
        return ""

    return store.reserve_evictions(decision_id, job, machines, now_ms - HOUR_MS, now_ms, refuse)


@dataclass(frozen=True)
class BreakerTrip:
    """Why the circuit breaker holds an eviction: its evidence."""

    job: str
    #: the detection kind and category the evictions share.
    kind: str
    category: str
    #: the decisions of the burst (acceptance order), their detections, the machines they ask for.
    decisions: tuple[str, ...]
    detections: tuple[str, ...]
    machines: tuple[str, ...]
    #: the job's machine count (None: not known) and the share of it asked for (None: unknown).
    job_machines: int | None
    share: float | None
    #: event time from the burst's first fault to its last.
    span_ms: int

    def reason(self, cfg: ActionsConfig) -> str:
        b = cfg.breaker
        of = (
            f"{len(self.machines)} of the job's {self.job_machines} machines ({self.share:.0%})"
            if self.job_machines and self.share is not None
            else f"{len(self.machines)} machines of a job whose size is not known"
        )
        return (
            f"circuit breaker: {len(self.decisions)} evictions of one cause ({self.category}, "
            f"{self.kind}) within {self.span_ms / 1000:g} s ask for {of} (trips at "
            f"{b.machine_share:.0%} and {b.min_machines} machines within {b.window_s:g} s): suspect the "
            f"detector or the environment, not the machines; machines {_named(self.machines)}; decisions "
            f"{_named(self.decisions)}; detections {_named(self.detections)}; nothing is evicted until "
            f"an operator runs `trainguard actions release <decision id>` (or cancels) for each"
        )


def breaker_trip(
    cfg: ActionsConfig, store: ProgressStore, rec: Recovery, machines: Sequence[str], job_machines: int | None
) -> BreakerTrip | None:
    """The burst of evictions of ``rec``'s cause that ``rec`` (about to evict ``machines``) belongs
    to, if it trips the breaker (:class:`~trainguard.actions.config.BreakerConfig`), else None.

    The burst: the job's ``evict`` decisions, in any state (done, running, queued, held), whose
    detection has ``rec``'s kind and category and whose fault (event time) falls in one window of
    ``breaker.window_s`` with ``rec``'s; of all such windows, the one asking for the most machines.
    It trips when it holds at least two decisions -- one eviction, however many machines its
    group spans, never trips it -- and asks for at least ``breaker.min_machines`` machines and at
    least ``breaker.machine_share`` of ``job_machines`` (the machine count of the job's spec).
    Where the job's size is not known (``job_machines`` None or 0: no spec), the share cannot be
    told and ``min_machines`` alone decides: the breaker errs towards holding.  A decision without
    a detection (an operator's, a code update) has no detector to suspect and never trips it.
    """
    b = cfg.breaker
    cause = _cause(rec.decision)
    if b.window_s <= 0 or rec.decision.action is not Action.EVICT or cause is None:
        return None
    window_ms, at = int(b.window_s * 1000), _event_ms(rec.decision)
    # Accepted no earlier than the oldest decision the service acts on before the window: a
    # burst's decisions are accepted after their faults.
    since = min(rec.accepted_ms, at) - window_ms - int(cfg.max_decision_age_s * 1000)
    burst = [
        r
        for r in store.evictions_asked(rec.job, since)
        if r.decision_id != rec.decision_id
        and _cause(r.decision) == cause
        and abs(_event_ms(r.decision) - at) <= window_ms
    ]
    asked = {r.decision_id: tuple(r.decision.targets.machines) for r in burst}
    asked[rec.decision_id] = tuple(dict.fromkeys([*rec.decision.targets.machines, *machines]))
    events = sorted([(_event_ms(r.decision), r) for r in burst] + [(at, rec)], key=lambda e: e[0])
    best = _widest(events, at, window_ms, asked)
    if len(best) < 2:
        return None
    wanted = sorted({m for _, r in best for m in asked[r.decision_id]})
    known = job_machines if job_machines and job_machines > 0 else None
    share = len(wanted) / known if known else None
    if len(wanted) < b.min_machines or (share is not None and share < b.machine_share):
        return None
    ordered = sorted((r for _, r in best), key=lambda r: r.seq)
    return BreakerTrip(
        job=rec.job,
        kind=cause[0],
        category=cause[1],
        decisions=tuple(r.decision_id for r in ordered),
        detections=tuple(d for r in ordered for d in r.decision.detection_ids),
        machines=tuple(wanted),
        job_machines=known,
        share=share,
        span_ms=best[-1][0] - best[0][0],
    )


def breaker_hold(
    cfg: ActionsConfig, store: ProgressStore, rec: Recovery, machines: Sequence[str], job_machines: int | None
) -> str:
    """Why evicting ``machines`` for ``rec`` must wait for an operator ("" when the breaker
    holds): :func:`breaker_trip`'s evidence, as the hold's reason."""
    trip = breaker_trip(cfg, store, rec, machines, job_machines)
    return trip.reason(cfg) if trip is not None else ""


def restart_hold(cfg: ActionsConfig, store: ProgressStore, job: str, now_ms: int) -> str:
    """Why restarting ``job`` again must wait for an operator ("" when the budget allows it)."""
    done = store.restarts_since(job, now_ms - int(cfg.restart_window_s * 1000))
    if done >= cfg.max_restarts:
        return (
            f"restart budget: job {job} was restarted {done} times in the last "
            f"{cfg.restart_window_s:g} s (budget {cfg.max_restarts}); it looks live-locked"
        )
    return ""


def _widest(
    events: list[tuple[int, Recovery]], at: int, window_ms: int, asked: dict[str, tuple[str, ...]]
) -> list[tuple[int, Recovery]]:
    """Of the windows of ``window_ms`` that hold time ``at``, the events of the one asking for the
    most distinct machines (``events`` sorted by time, each within ``window_ms`` of ``at``)."""
    held: Counter[str] = Counter()
    best: list[tuple[int, Recovery]] = []
    best_n, hi = 0, 0
    for lo, (start, _) in enumerate(events):
        if start > at:
            break
        if lo:  # the window moves past the previous event
            for m in asked[events[lo - 1][1].decision_id]:
                held[m] -= 1
                if not held[m]:
                    del held[m]
        while hi < len(events) and events[hi][0] <= start + window_ms:
            held.update(asked[events[hi][1].decision_id])
            hi += 1
        if len(held) > best_n:
            best_n, best = len(held), events[lo:hi]
    return best


def _cause(decision: Decision) -> tuple[str, str] | None:
    """(kind, category) of the detection behind ``decision``; None without one."""
    det = decision.evidence.get("detection") if isinstance(decision.evidence, dict) else None
    if not isinstance(det, dict) or not (det.get("kind") or det.get("category")):
        return None
    return str(det.get("kind", "")), str(det.get("category", ""))


def _event_ms(decision: Decision) -> int:
    """Event time of the fault behind ``decision`` (its detection's input), else its own time."""
    det = decision.evidence.get("detection") if isinstance(decision.evidence, dict) else None
    ts = det.get("source_ts_ms") if isinstance(det, dict) else None
    return int(ts) if isinstance(ts, int | float) and ts > 0 else decision.ts_ms


def _named(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_NAMED])
    return f"[{shown}{f', ... ({len(items) - _NAMED} more)' if len(items) > _NAMED else ''}]"
