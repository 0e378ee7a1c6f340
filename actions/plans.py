"""Decision (+ job history) -> recovery plan: the ordered steps, as a pure function.

ByteRobust's flow (§4.2-§4.3, §6):

* ``evict``    -- machine-specific fault or over-eviction verdict: stop, evict the targets, swap in
  warm standbys, restart from the latest complete checkpoint, replenish the pool;
* ``diagnose`` -- crash or NaN without a culprit: stop, stop-time tests; machines that fail are
  evicted as above; if all pass the **escalation level** picks the next rung: reattempt (restart),
  then roll back the latest code change, then dual-phase replay, then an operator;
* ``rollback`` -- user-code error: hot-update to the previous version in place, no rescheduling;
* ``restart``  -- restart in place; with ``evidence["code_update"]`` an operator's code update:
  urgent ones now, others queued for the next recovery (forced after a deadline).

**Rungs that cannot run are skipped, never held.**  Stop-time tests need test commands, a
rollback needs an earlier code version (and an executor that can switch versions), dual-phase
replay needs a replay command and a layout that splits into groups.  A rung missing one of these
is skipped -- the reason goes into :attr:`Plan.skipped`, which the runner records as a
``skipped`` step of the recovery and logs -- and the ladder goes on to the next rung that can
run, ultimately a plain restart: a site with the documented minimal executor configuration
(no ``replay_command``) gets restarts, not a recovery held with the job down.  What an executor
cannot do for want of configuration, it says in ``Executor.unconfigured()``, frozen in
:attr:`PlanContext.unconfigured` when the recovery starts.

Plans that branch on a step's result (diagnose, replay) are rebuilt from the results recorded so
far: :func:`build_plan` is called again after each step, and since its inputs (the decision, the
:class:`PlanContext` snapshot stored when the recovery started, the stored results) survive a
restart, a resumed recovery re-plans exactly what it would have done.

>>> from trainguard.schemas.control import Decision, Targets
>>> from trainguard.schemas.enums import Action
>>> d = Decision(decision_id="d", ts_ms=0, job="j", action=Action.EVICT,
...              targets=Targets(machines=["n1"], group_kind="machine"))
>>> ctx = PlanContext(machines=("n0", "n1"), pp=1)
>>> [s.key for s in build_plan(d, ctx, {}).steps]
['stop', 'evict', 'swap_standbys', 'restart', 'replenish']
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from trainguard.actions.state import RecoveryState
from trainguard.detectors.planning import (
    PlanningError,
    ReplayPlan,
    locate_from_results,
    plan_dual_phase_replay,
)
from trainguard.schemas.control import Decision
from trainguard.schemas.enums import Action


class StepKind(StrEnum):
    STOP = "stop"
    DIAGNOSE = "diagnose"
    REPLAY_HORIZONTAL = "replay_horizontal"
    REPLAY_VERTICAL = "replay_vertical"
    EVICT = "evict"
    SWAP_STANDBYS = "swap_standbys"
    HOT_UPDATE = "hot_update"
    RESTART = "restart"
    REPLENISH = "replenish"
    QUEUE_UPDATE = "queue_update"


#: the recovery state a step runs in.
STATE_OF: dict[StepKind, RecoveryState] = {
    StepKind.STOP: RecoveryState.STOPPING,
    StepKind.DIAGNOSE: RecoveryState.DIAGNOSING,
    StepKind.REPLAY_HORIZONTAL: RecoveryState.REPLAYING,
    StepKind.REPLAY_VERTICAL: RecoveryState.REPLAYING,
    StepKind.EVICT: RecoveryState.EVICTING,
    StepKind.SWAP_STANDBYS: RecoveryState.SWAPPING,
    StepKind.HOT_UPDATE: RecoveryState.UPDATING,
    StepKind.RESTART: RecoveryState.RESTARTING,
    StepKind.REPLENISH: RecoveryState.REPLENISHING,
    StepKind.QUEUE_UPDATE: RecoveryState.PENDING,
}


class Escalation:
    """Rungs of the stop-time escalation ladder (what a crash *without* culprit leads to)."""

    REATTEMPT = 0
    ROLLBACK = 1
    REPLAY = 2
    OPERATOR = 3


#: the executor method (:class:`~trainguard.actions.executors.base.Executor`) each skippable rung
#: needs: a rung whose method is in :attr:`PlanContext.unconfigured` is skipped.
RUNG_NEEDS: dict[str, str] = {
    "diagnose": "run_diagnostics",
    "rollback": "hot_update",
    "replay": "run_replay",
}


@dataclass(frozen=True)
class Step:
    key: str
    kind: StepKind
    machines: tuple[str, ...] = ()
    version: str = ""
    tests: tuple[str, ...] = ()
    groups: tuple[tuple[str, ...], ...] = ()
    note: str = ""


@dataclass(frozen=True)
class CodeUpdate:
    """An operator's code change request (``evidence["code_update"]`` of a restart decision)."""

    version: str
    urgent: bool = False
    #: the version running before it, recorded as the job's baseline when none is known yet.
    previous: str = ""
    forced: bool = False

    def decision(self, job: str, decision_id: str, ts_ms: int, reason: str = "") -> Decision:
        """The restart decision that carries this request (the inverse of :func:`code_update_of`)."""
        raw: dict[str, object] = {"version": self.version, "urgent": self.urgent}
        if self.previous:
            raw["previous"] = self.previous
        if self.forced:
            raw["forced"] = True
        return Decision(
            decision_id=decision_id,
            ts_ms=ts_ms,
            job=job,
            action=Action.RESTART,
            reason=reason or f"operator code update to {self.version}",
            evidence={"code_update": raw},
        )


def code_update_of(decision: Decision) -> CodeUpdate | None:
    raw = decision.evidence.get("code_update") if isinstance(decision.evidence, dict) else None
    if not isinstance(raw, dict) or not raw.get("version"):
        return None
    return CodeUpdate(
        version=str(raw["version"]),
        urgent=bool(raw.get("urgent", False)),
        previous=str(raw.get("previous") or ""),
        forced=bool(raw.get("forced", False)),
    )


@dataclass(frozen=True)
class PlanContext:
    """What the plan depends on besides the decision, frozen when the recovery starts."""

    #: the job's machines (names, in machine-index order) when the recovery started.
    machines: tuple[str, ...]
    pp: int = 1
    #: rung of the escalation ladder a crash without culprit reaches (:class:`Escalation`).
    level: int = Escalation.REATTEMPT
    #: version a rollback goes back to ("" when no earlier version is recorded).
    rollback_target: str = ""
    #: a queued non-urgent code update applied at this recovery ("" when none).
    pending_update: str = ""
    tests: tuple[str, ...] = ("alignment", "connectivity")
    replay_k: int = 1
    #: executor methods this site's configuration cannot perform -> what is missing
    #: (``Executor.unconfigured()``); the rungs needing them (:data:`RUNG_NEEDS`) are skipped.
    unconfigured: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "machines": list(self.machines),
            "pp": self.pp,
            "level": self.level,
            "rollback_target": self.rollback_target,
            "pending_update": self.pending_update,
            "tests": list(self.tests),
            "replay_k": self.replay_k,
            "unconfigured": dict(self.unconfigured),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlanContext:
        return cls(
            machines=tuple(data["machines"]),
            pp=int(data["pp"]),
            level=int(data["level"]),
            rollback_target=str(data["rollback_target"]),
            pending_update=str(data["pending_update"]),
            tests=tuple(data["tests"]),
            replay_k=int(data["replay_k"]),
            # absent from contexts stored before rungs were skipped: everything was configured
            unconfigured={str(k): str(v) for k, v in (data.get("unconfigured") or {}).items()},
        )

    def cannot(self, rung: str) -> str:
        """Why the executor cannot run ``rung`` ("" when it can, or the rung needs nothing)."""
        method = RUNG_NEEDS.get(rung, "")
        why = self.unconfigured.get(method, "") if method else ""
        return f"the executor cannot {method}: {why}" if why else ""


@dataclass(frozen=True)
class Plan:
    steps: tuple[Step, ...]
    #: evict / diagnose_evict / reattempt / rollback / replay / update / restart / queue_update /
    #: ignored / superseded -- which rung of the flow this recovery took (a skipped rung keeps
    #: its name: its steps are a restart, and :attr:`skipped` says why).
    path: str
    #: False while the rest depends on a step result not known yet (diagnose, replay).
    complete: bool = True
    #: non-empty: the plan cannot go on without an operator (the reason).
    hold: str = ""
    #: rung a crash without culprit right after this recovery reaches (None: no effect).
    next_level: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    #: (rung, why) of each rung this plan skipped because it cannot run here.
    skipped: tuple[tuple[str, str], ...] = ()


def _s(kind: StepKind, **kw: Any) -> Step:
    return Step(key=kind.value, kind=kind, **kw)


def _evict_tail(machines: list[str], pending: str) -> list[Step]:
    ms = tuple(machines)
    steps = [_s(StepKind.EVICT, machines=ms), _s(StepKind.SWAP_STANDBYS, machines=ms)]
    if pending:  # §6.1: non-urgent updates ride along with the next recovery
        steps.append(_s(StepKind.HOT_UPDATE, version=pending, note="lazy update"))
    return [*steps, _s(StepKind.RESTART), _s(StepKind.REPLENISH)]


def _restart_tail(pending: str) -> list[Step]:
    lazy = [_s(StepKind.HOT_UPDATE, version=pending, note="lazy update")] if pending else []
    return [*lazy, _s(StepKind.RESTART)]


def build_plan(decision: Decision, ctx: PlanContext, results: Mapping[str, Any]) -> Plan:
    """The recovery plan for ``decision`` given the step ``results`` recorded so far."""
    action = decision.action
    stop = _s(StepKind.STOP)
    if action is Action.EVICT:
        present = set(ctx.machines)
        targets = sorted(m for m in decision.targets.machines if m in present)
        if not targets:
            return Plan((), "superseded", detail={"why": "no target machine is part of the job any more"})
        return Plan(
            (stop, *_evict_tail(targets, ctx.pending_update)), "evict", next_level=Escalation.ROLLBACK
        )
    if action is Action.ROLLBACK:
        why = _cannot_roll_back(ctx)
        if why:  # restart in place; the restart budget stops a crash loop of the same code
            return Plan(
                (stop, _s(StepKind.RESTART)),
                "rollback",
                next_level=Escalation.REPLAY,
                skipped=(("rollback", why),),
            )
        steps = (
            stop,
            _s(StepKind.HOT_UPDATE, version=ctx.rollback_target, note="rollback"),
            _s(StepKind.RESTART),
        )
        return Plan(steps, "rollback", next_level=Escalation.REPLAY)
    if action is Action.RESTART:
        update = code_update_of(decision)
        if update is None:
            return Plan((stop, *_restart_tail(ctx.pending_update)), "restart", next_level=Escalation.ROLLBACK)
        if not update.urgent:
            return Plan((_s(StepKind.QUEUE_UPDATE, version=update.version),), "queue_update")
        steps = (
            stop,
            _s(StepKind.HOT_UPDATE, version=update.version, note="urgent update"),
            _s(StepKind.RESTART),
        )
        # a crash right after a code change points at the code: the next rung is rollback.
        return Plan(steps, "update", next_level=Escalation.ROLLBACK)
    if action is Action.DIAGNOSE:
        return _diagnose_plan(ctx, results)
    return Plan((), "ignored", detail={"why": f"{action.value} decisions are handled by the stream workers"})


def _cannot_roll_back(ctx: PlanContext) -> str:
    """Why the rollback rung cannot run for this job ("" when it can)."""
    if not ctx.rollback_target:
        return "no earlier code version is recorded for this job to roll back to"
    return ctx.cannot("rollback")


def _dual_phase(ctx: PlanContext) -> tuple[ReplayPlan | None, str]:
    """The job's dual-phase replay groups, or None and why the replay rung cannot run."""
    why = ctx.cannot("replay")
    if why:
        return None, why
    n = len(ctx.machines)
    try:
        if ctx.pp < 1 or n % ctx.pp:
            raise PlanningError(f"{n} machines do not split into pipelines of {ctx.pp}")
        return plan_dual_phase_replay(pp=ctx.pp, dp=n // ctx.pp, k=ctx.replay_k, n_machines=n), ""
    except PlanningError as exc:
        return None, f"dual-phase replay impossible: {exc}"


def _diagnose_plan(ctx: PlanContext, results: Mapping[str, Any]) -> Plan:
    skipped: list[tuple[str, str]] = []
    head = [_s(StepKind.STOP)]
    why = ctx.cannot("diagnose") or ("" if ctx.tests else "no stop-time tests are configured")
    if why:  # nothing tested, so nothing flagged: the escalation level decides alone
        skipped.append(("diagnose", why))
        diag: Mapping[str, Any] = {"failed": []}
    else:
        head.append(_s(StepKind.DIAGNOSE, machines=ctx.machines, tests=ctx.tests))
        found = results.get(StepKind.DIAGNOSE.value)
        if found is None:
            return Plan(tuple(head), "diagnose", complete=False)
        diag = found
    failed = sorted(diag.get("failed") or [])
    if failed:  # step ④: evict what the stop-time tests flagged
        return Plan(
            tuple(head + _evict_tail(failed, ctx.pending_update)),
            "diagnose_evict",
            next_level=1,
            skipped=tuple(skipped),
        )
    level = ctx.level
    if level == Escalation.ROLLBACK:
        why = _cannot_roll_back(ctx)
        if why:  # go on to the next rung
            skipped.append(("rollback", why))
            level = Escalation.REPLAY
    if level == Escalation.REATTEMPT:  # step ⑤: transient; restart directly
        return Plan(
            tuple(head + _restart_tail(ctx.pending_update)),
            "reattempt",
            next_level=Escalation.ROLLBACK,
            skipped=tuple(skipped),
        )
    if level == Escalation.ROLLBACK:  # steps ⑥/⑦
        steps = [
            *head,
            _s(StepKind.HOT_UPDATE, version=ctx.rollback_target, note="rollback"),
            _s(StepKind.RESTART),
        ]
        return Plan(tuple(steps), "rollback", next_level=Escalation.REPLAY, skipped=tuple(skipped))
    if level == Escalation.REPLAY:  # steps ⑧/⑨
        rp, why = _dual_phase(ctx)
        if rp is None:
            # Nothing left that localises the fault here: restart (no new code, as a replay's
            # eviction would), and the next crash goes to an operator.
            skipped.append(("replay", why))
            return Plan(
                tuple(head + _restart_tail("")),
                "replay",
                next_level=Escalation.OPERATOR,
                skipped=tuple(skipped),
            )
        return _replay_plan(ctx, rp, head, results, tuple(skipped))
    return Plan(
        tuple(head),
        "operator",
        hold="diagnose, reattempt, rollback and dual-phase replay did not keep the job running",
        skipped=tuple(skipped),
    )


def _replay_plan(
    ctx: PlanContext,
    rp: ReplayPlan,
    head: list[Step],
    results: Mapping[str, Any],
    skipped: tuple[tuple[str, str], ...],
) -> Plan:
    def named(groups: tuple[tuple[int, ...], ...]) -> tuple[tuple[str, ...], ...]:
        return tuple(tuple(ctx.machines[i] for i in g) for g in groups)

    detail = {"m": rp.m, "n": rp.n, "k": rp.k}
    steps = [
        *head,
        _s(StepKind.REPLAY_HORIZONTAL, groups=named(rp.horizontal)),
        _s(StepKind.REPLAY_VERTICAL, groups=named(rp.vertical)),
    ]
    h, v = results.get(StepKind.REPLAY_HORIZONTAL.value), results.get(StepKind.REPLAY_VERTICAL.value)
    if h is None or v is None:
        return Plan(tuple(steps), "replay", complete=False, detail=detail, skipped=skipped)
    try:
        faulty = ctx.machines[locate_from_results(rp, list(h["ok"]), list(v["ok"]))]
    except PlanningError as exc:
        return Plan(
            tuple(steps),
            "replay",
            hold=f"replay did not isolate one machine: {exc}",
            detail=detail,
            skipped=skipped,
        )
    tail = _evict_tail([faulty], "")  # no new code while localising an unknown fault
    return Plan(
        tuple(steps + tail),
        "replay",
        next_level=Escalation.OPERATOR,
        detail={**detail, "faulty": faulty},
        skipped=skipped,
    )
