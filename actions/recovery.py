"""Runs one recovery to its end: plan, guard, execute each step with retries, record, announce.

The loop is *plan -> first step without a recorded result -> run it -> record it -> re-plan*.
Because the plan is a pure function of stored inputs (:mod:`trainguard.actions.plans`), a recovery
interrupted by a crash resumes at the step that was in flight (executors are idempotent), and a
finished step is never run twice.  Each step emits ``started`` and ``succeeded``/``failed``
action events with deterministic ids (redelivered events collapse in ClickHouse); a step's
``succeeded`` event is re-sent on resume if the crash came between recording and sending it.
Each attempt's duration and outcome, and each hold, are counted in :mod:`trainguard.actions.metrics`.
A rung the plan skips (:attr:`trainguard.actions.plans.Plan.skipped`: it cannot run with this
site's configuration) is logged once and recorded as a ``skipped`` step with its reason.

Swapping standbys takes the spec's pool plus the machines an operator offered
(``trainguard actions add-standby`` / ``return-node``), never a machine evicted and not offered
back since.  After an operator released a swap that found no spare machine, the pool is asked
of the executor again (``usable_machines``: the allocation's nodes Slurm reports usable, the
nodes Kubernetes reports Ready and schedulable) instead of taken from the stale spec.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any, Protocol

from trainguard.actions import guard, placement
from trainguard.actions.config import ActionsConfig
from trainguard.actions.errors import PermanentError, TemporaryError
from trainguard.actions.executors.base import Executor, StepContext
from trainguard.actions.metrics import ActionMetrics
from trainguard.actions.plans import (
    STATE_OF,
    CodeUpdate,
    Plan,
    PlanContext,
    Step,
    StepKind,
    build_plan,
    code_update_of,
)
from trainguard.actions.progress import ProgressStore, Recovery
from trainguard.actions.standby import machine_names, pool_target, refilled, swapped
from trainguard.actions.state import RecoveryState
from trainguard.infra.backoff import Backoff
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import ActionEvent, ActionPhase, Decision, JobSpec, Targets, stable_id
from trainguard.schemas.enums import Action
from trainguard.schemas.typecheck import from_mapping, to_plain

log = logging.getLogger(__name__)


class Publisher(Protocol):
    """Where the runner's events go (Kafka in the service)."""

    def action(self, event: ActionEvent) -> None:
        """Send an action event (raise on failure; the runner logs and carries on)."""

    def job_spec(self, spec: JobSpec) -> None:
        """Send a job spec and wait for the broker's acknowledgement (raise on failure)."""


class RecoveryRunner:
    def __init__(
        self,
        cfg: ActionsConfig,
        store: ProgressStore,
        executor: Executor,
        publisher: Publisher,
        spec_of: Callable[[str], JobSpec | None],
        stop: threading.Event | None = None,
        clock: Callable[[], int] = now_ms,
        metrics: ActionMetrics | None = None,
    ) -> None:
        self.cfg, self.store, self.executor, self.publisher = cfg, store, executor, publisher
        self.metrics = metrics or ActionMetrics()
        self.spec_of = spec_of
        self.stop = stop or threading.Event()
        self.clock = clock
        #: the stop-time tests diagnose steps run (raises ValueError when the executor lacks one).
        self.tests = cfg.diagnostic_tests(tuple(executor.diagnostic_tests))
        #: what this executor cannot do for want of configuration (the plans skip those rungs).
        self.unconfigured = _unconfigured(executor)

    # --- events ----------------------------------------------------------------------------------

    def _emit(
        self,
        rec: Recovery,
        step: str,
        phase: ActionPhase,
        *,
        attempt: int = 0,
        duration_ms: float = 0.0,
        detail: str = "",
        machines: tuple[str, ...] | list[str] = (),
    ) -> bool:
        d = rec.decision
        ev = ActionEvent(
            event_id=stable_id(d.decision_id, step, phase.value, attempt),
            decision_id=d.decision_id,
            ts_ms=self.clock(),
            job=d.job,
            step=step,
            phase=phase,
            action=d.action,
            duration_ms=max(0.0, duration_ms),
            detail=detail[:60_000],
            targets=Targets(machines=list(machines), ranks=[], group_kind=d.targets.group_kind),
        )
        try:
            self.publisher.action(ev)
            return True
        except Exception as exc:  # Kafka down must not stop a recovery; events are re-sent on resume
            log.warning("could not publish action event %s/%s: %s", step, phase.value, exc)
            return False

    # --- entry point -----------------------------------------------------------------------------

    def run(self, decision_id: str) -> Recovery:
        """Drive the recovery as far as it can go now (to its end, a hold, or a stop request)."""
        rec = self.store.get(decision_id)
        if rec is None:
            raise KeyError(f"no recovery {decision_id}")
        if rec.state.terminal or rec.state is RecoveryState.HELD:
            return rec
        if rec.context is None:
            rec = self._start(rec)
            if rec.state.terminal or rec.state is RecoveryState.HELD:
                return rec
        self._announce_done_steps(rec)
        while not self.stop.is_set():
            if self.store.paused() is not None:  # an operator paused the service: no new step
                return rec
            assert rec.context is not None
            results = self.store.step_results(decision_id)
            plan = build_plan(rec.decision, PlanContext.from_json(rec.context["plan"]), results)
            self._record_skips(rec, plan)
            if plan.hold:
                return self._hold(rec, plan.hold, "plan", "plan")
            step = next((s for s in plan.steps if s.key not in results), None)
            if step is None:
                if not plan.complete:  # a branching step's result is missing: a bug, not a fault
                    return self._fail(rec, f"plan {plan.path} is incomplete after all its steps")
                return self._finish(rec, plan)
            state = STATE_OF[step.kind]
            if state is not rec.state and state is not RecoveryState.PENDING:
                rec = self.store.transition(decision_id, state)
            if step.kind is StepKind.EVICT and StepKind.EVICT.value not in rec.released:
                # Checked again here, not only at the start: the rest of a burst may have come in
                # while this recovery stopped the job.  Released at its start, it was an operator's
                # call already.
                if plan.steps[0].key not in rec.released:
                    spec = self._spec_now(rec, results)
                    reason = guard.breaker_hold(
                        self.cfg, self.store, rec, step.machines, spec.topology.num_machines
                    )
                    if reason:
                        return self._hold(rec, reason, step.key, "breaker")
                reason = guard.eviction_hold(
                    self.cfg, self.store, rec.decision_id, rec.job, list(step.machines), self.clock()
                )
                if reason:
                    return self._hold(rec, reason, step.key, "blast_radius")
            error = self._run_step(rec, step, results)
            if error:
                return self._step_failed(rec, step, error)
            rec = self.store.get(decision_id) or rec
        return rec

    # --- lifecycle -------------------------------------------------------------------------------

    def _start(self, rec: Recovery) -> Recovery:
        d, now = rec.decision, self.clock()
        merged_into = self._running_when_accepted(rec, rollback=d.action is Action.ROLLBACK)
        if merged_into is not None and (
            d.action in (Action.DIAGNOSE, Action.ROLLBACK)
            or (d.action is Action.RESTART and code_update_of(d) is None)
            or (d.action is Action.EVICT and _from_stacks(d))
        ):
            # The running recovery stopped and restarted the whole job: this crash report is most
            # likely the stop itself, and escalating on it would roll back healthy code.  Likewise
            # a "hang" localised from stacks while the job was stopped for that recovery is the
            # recovery's own pause (explicit machine faults, Xid and the like, still evict).
            return self._end(
                rec, RecoveryState.SUPERSEDED, f"arrived while recovery {merged_into} of the job was running"
            )
        update = code_update_of(d)
        if update is not None and update.previous:
            self.store.record_baseline(rec.job, update.previous, d.decision_id, now)
        spec = self._wait_for_spec(rec.job)
        if spec is None:
            return self._end(rec, RecoveryState.FAILED, f"no JobSpec for job {rec.job} on the jobs topic")
        ctx = self._context(rec, spec, update)
        context = {"plan": ctx.to_json(), "spec": to_plain(spec)}
        plan = build_plan(d, ctx, {})
        if plan.path in ("ignored", "superseded"):
            state = RecoveryState.IGNORED if plan.path == "ignored" else RecoveryState.SUPERSEDED
            return self._end(rec, state, str(plan.detail.get("why", "")), context=context, path=plan.path)
        rec = self.store.transition(
            rec.decision_id, rec.state, context=context, started_ms=now, path=plan.path
        )
        self._emit(rec, "recovery", ActionPhase.STARTED, detail=f"path={plan.path} level={ctx.level}")
        # Before the job is stopped: a burst the breaker holds leaves the job training.  Both
        # guards are asked, so one release answers every reason to hold at this step.
        holds: list[tuple[str, str]] = []
        first = plan.steps[0].key if plan.steps else ""
        evict = next((s for s in plan.steps if s.kind is StepKind.EVICT), None)
        if evict is not None and first not in rec.released:
            size = spec.topology.num_machines
            holds.append(("breaker", guard.breaker_hold(self.cfg, self.store, rec, evict.machines, size)))
        if any(s.kind is StepKind.RESTART for s in plan.steps) and first not in rec.released:
            holds.append(("restart_budget", guard.restart_hold(self.cfg, self.store, rec.job, now)))
        holds = [(which, why) for which, why in holds if why]
        if holds:
            return self._hold(rec, "; ".join(why for _, why in holds), first, holds[0][0])
        return rec

    def _running_when_accepted(self, rec: Recovery, rollback: bool = False) -> str | None:
        """The recovery that already covers ``rec`` (for a rollback: only another rollback, since
        the crash of freshly pushed code must still roll it back)."""
        for other in reversed(self.store.recoveries(rec.job, limit=20)):
            if other.seq >= rec.seq or other.started_ms is None:
                continue
            finished = other.finished_ms or rec.accepted_ms
            during = other.started_ms <= rec.accepted_ms <= finished
            # A crash that *happened* before that recovery restarted the job is old news even if
            # its report arrived later (ranks of the stopped generation die reporting errors).
            event_ms = _source_ms(rec.decision)
            stale = event_ms is not None and other.started_ms - _STALE_GRACE_MS <= event_ms <= finished
            if rollback and other.path != "rollback":
                continue
            if (during or stale) and other.state is RecoveryState.SUCCEEDED and other.path != "queue_update":
                return other.decision_id
        return None

    def _wait_for_spec(self, job: str) -> JobSpec | None:
        deadline = time.monotonic() + self.cfg.spec_wait_s
        while True:
            spec = self.spec_of(job)
            if spec is not None or time.monotonic() >= deadline or self.stop.is_set():
                return spec
            time.sleep(0.2)

    def _context(self, rec: Recovery, spec: JobSpec, update: CodeUpdate | None) -> PlanContext:
        """What ``rec``'s plan depends on.  Its escalation rung comes from the latest recovery
        of the same cause (detection category) that finished within ``escalation_window_s``, or
        of a code update (a crash right after one points at the code): a crash after an
        unrelated recovery -- an Xid eviction -- is a first incident, at the first rung."""
        level = 0
        cause = _category(rec.decision)
        last = self.store.last_finished(
            rec.job,
            rec.seq,
            since_ms=rec.accepted_ms - int(self.cfg.escalation_window_s * 1000),
            shapes=lambda other: other.path == "update" or _category(other.decision) == cause,
        )
        if last is not None and last.next_level is not None:
            level = last.next_level
        stack = self.store.version_stack(rec.job)
        pending = self.store.pending_updates(rec.job)
        lazy = pending[-1].version if pending and rec.decision.action is not Action.ROLLBACK else ""
        if update is not None:
            lazy = ""  # an operator's update decides the version itself
        return PlanContext(
            machines=tuple(machine_names(spec)),
            pp=spec.topology.pp,
            level=level,
            rollback_target=stack[-2] if len(stack) >= 2 else "",
            pending_update=lazy,
            tests=self.tests,
            replay_k=self.cfg.replay_k,
            unconfigured=self.unconfigured,
        )

    def _end(self, rec: Recovery, state: RecoveryState, detail: str, **fields: Any) -> Recovery:
        now = self.clock()
        rec = self.store.transition(rec.decision_id, state, finished_ms=now, detail=detail, **fields)
        phase = ActionPhase.FAILED if state is RecoveryState.FAILED else ActionPhase.SUCCEEDED
        self._emit(rec, "recovery", phase, detail=f"{state.value}: {detail}")
        return rec

    def _finish(self, rec: Recovery, plan: Plan) -> Recovery:
        now = self.clock()
        skipped = _skips(plan)
        rec = self.store.transition(
            rec.decision_id,
            RecoveryState.SUCCEEDED,
            finished_ms=now,
            path=plan.path,
            next_level=plan.next_level,
            detail=_join(str(plan.detail) if plan.detail else "", skipped),
        )
        took = now - (rec.started_ms or now)
        self._emit(
            rec,
            "recovery",
            ActionPhase.SUCCEEDED,
            duration_ms=took,
            detail=_join(f"path={plan.path}", skipped),
        )
        log.info("recovery %s of job %s succeeded (%s) in %d ms", rec.decision_id, rec.job, plan.path, took)
        return rec

    def _fail(self, rec: Recovery, error: str) -> Recovery:
        log.error("recovery %s of job %s failed: %s", rec.decision_id, rec.job, error)
        return self._end(rec, RecoveryState.FAILED, error)

    def _step_failed(self, rec: Recovery, step: Step, error: str) -> Recovery:
        """A step failed for good (a permanent error, or its retries and budget spent).

        The job is stopped or half-recovered at this point, so ending the recovery as "failed"
        would leave it silently dead.  It is held instead, with an ERROR line and a ``held``
        action event that say what an operator must provide; ``trainguard actions release``
        then runs the step again (``cancel`` gives the job up)."""
        needed = _NEEDED.get(step.kind, "fix the cause named in the error").format(job=rec.job)
        policy = self.cfg.policy(step.kind.value)
        reason = (
            f"step {step.key} failed for good ({error}); needed: {needed}; then run "
            f"`trainguard actions release {rec.decision_id}` to run the step again"
            f" (retries {policy.retries}, budget {policy.budget_s:g} s per run of the step)"
        )
        return self._hold(rec, reason, step.key, "step_failed", level=logging.ERROR)

    def _hold(
        self, rec: Recovery, reason: str, step: str, guard: str, level: int = logging.WARNING
    ) -> Recovery:
        """Hold ``rec`` at ``step`` for an operator; ``guard`` says which
        (:data:`trainguard.actions.metrics.GUARDS`)."""
        log.log(level, "recovery %s of job %s held for an operator: %s", rec.decision_id, rec.job, reason)
        rec = self.store.transition(rec.decision_id, RecoveryState.HELD, held_reason=reason, held_step=step)
        self.metrics.held(guard, step)
        self._emit(rec, step if step != "plan" else "recovery", ActionPhase.HELD, detail=reason)
        return rec

    def _record_skips(self, rec: Recovery, plan: Plan) -> None:
        """Record (and log, once) each rung ``plan`` skipped as a ``skipped`` step of ``rec``."""
        for rung, why in plan.skipped:
            if self.store.step_skipped(rec.decision_id, rung, why, self.clock()):
                log.warning(
                    "recovery %s of job %s: %s skipped (%s); going on to the next rung",
                    rec.decision_id,
                    rec.job,
                    rung,
                    why,
                )

    def _announce_done_steps(self, rec: Recovery) -> None:
        for key in self.store.unannounced(rec.decision_id):
            if self._emit(rec, key, ActionPhase.SUCCEEDED, attempt=-1, detail="recorded before a restart"):
                self.store.mark_announced(rec.decision_id, key)

    # --- steps -----------------------------------------------------------------------------------

    def _executor_detail(self, ctx: StepContext) -> str:
        """What the executor changed for this step (the Slurm executor: the commands it ran,
        ``Executor.detail``, optional), for the step's action event; never fails the step."""
        detail = getattr(self.executor, "detail", None)
        if not callable(detail):
            return ""
        try:
            return str(detail(ctx.op_id))
        except Exception as exc:  # a report must not turn a done step into a failed one
            log.warning("executor detail of %s: %s", ctx.op_id, exc)
            return ""

    def _spec_now(self, rec: Recovery, results: dict[str, Any]) -> JobSpec:
        assert rec.context is not None
        raw = rec.context["spec"]
        for key in (StepKind.SWAP_STANDBYS.value, StepKind.REPLENISH.value):
            if key in results and "spec" in results[key]:
                raw = results[key]["spec"]
        return from_mapping(JobSpec, raw)

    def _run_step(self, rec: Recovery, step: Step, results: dict[str, Any]) -> str:
        """Run one step with retries/backoff; "" on success, else the error."""
        policy = self.cfg.policy(step.kind.value)
        spec = self._spec_now(rec, results)
        backoff = Backoff(initial_s=policy.backoff_s, max_s=policy.backoff_max_s)
        tries, first_ms = 0, self.clock()
        while True:
            tries += 1
            attempt = self.store.step_started(rec.decision_id, step.key, self.clock())
            detail = "resumed after a restart" if attempt > tries else ""
            self._emit(
                rec, step.key, ActionPhase.STARTED, attempt=attempt, detail=detail, machines=step.machines
            )
            deadline = time.monotonic() + policy.timeout_s
            ctx = StepContext(rec.decision_id, step.key, attempt, deadline, _category(rec.decision))
            t0 = time.monotonic()
            delay: float | None = None
            try:
                result, side = self._execute(rec, step, spec, ctx)
            except PermanentError as exc:
                error = f"{exc}"
                retry = False
            except Exception as exc:  # TemporaryError, or an executor bug: retried, bounded
                error = f"{type(exc).__name__}: {exc}"
                spent = (self.clock() - first_ms) / 1000
                retry = tries <= policy.retries and spent < policy.budget_s and not self.stop.is_set()
                if isinstance(exc, TemporaryError) and exc.delay is not None:
                    # The executor knows when to come back; later waits double from there.
                    delay = exc.delay
                    backoff = Backoff(initial_s=delay, max_s=policy.backoff_max_s)
                    backoff.next_delay()
            else:
                took = (time.monotonic() - t0) * 1000
                self.metrics.step(step.kind.value, "succeeded", took / 1000)
                self.store.step_done(rec.decision_id, step.key, result, self.clock(), job=rec.job, **side)
                if self._emit(
                    rec,
                    step.key,
                    ActionPhase.SUCCEEDED,
                    attempt=attempt,
                    duration_ms=took,
                    detail=_join(_describe(step, result), self._executor_detail(ctx)),
                    machines=step.machines,
                ):
                    self.store.mark_announced(rec.decision_id, step.key)
                return ""
            took = (time.monotonic() - t0) * 1000
            again = retry and step.kind is not StepKind.REPLENISH
            self.metrics.step(step.kind.value, "retried" if again else "failed", took / 1000)
            if step.kind is StepKind.REPLENISH:  # the job runs already: a thin pool is not a failed recovery
                self.store.step_done(rec.decision_id, step.key, {"failed": error}, self.clock(), job=rec.job)
                self._emit(rec, step.key, ActionPhase.FAILED, attempt=attempt, duration_ms=took, detail=error)
                return ""
            wait = backoff.next_delay() if delay is None else delay
            suffix = f"; retrying in {wait:g} s" if retry else ""
            self._emit(
                rec, step.key, ActionPhase.FAILED, attempt=attempt, duration_ms=took, detail=error + suffix
            )
            if not retry:
                self.store.step_failed(rec.decision_id, step.key, error, self.clock())
                return error
            self.stop.wait(wait)

    def _execute(
        self, rec: Recovery, step: Step, spec: JobSpec, ctx: StepContext
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Perform ``step``: (result to record, side effects for the store's logs)."""
        ex, kind, machines = self.executor, step.kind, list(step.machines)
        if kind is StepKind.STOP:
            ex.stop(spec, ctx)
            return {}, {}
        if kind is StepKind.DIAGNOSE:
            found = ex.run_diagnostics(spec, machines, list(step.tests), ctx)
            failed = sorted({r.machine for r in found if not r.passed})
            return {"failed": failed, "results": [asdict(r) for r in found]}, {}
        if kind in (StepKind.REPLAY_HORIZONTAL, StepKind.REPLAY_VERTICAL):
            groups = [list(g) for g in step.groups]
            ok = ex.run_replay(spec, groups, ctx)
            if len(ok) != len(groups):
                raise PermanentError(f"replay returned {len(ok)} results for {len(groups)} groups")
            return {"ok": list(ok), "groups": groups}, {}
        if kind is StepKind.EVICT:
            ex.evict(spec, machines, ctx)
            return {"evicted": machines}, {"evicted": machines}
        if kind is StepKind.SWAP_STANDBYS:
            return self._swap(rec, spec, machines, ctx), {}
        if kind is StepKind.HOT_UPDATE:
            ex.hot_update(spec, step.version, ctx)
            change = "rollback" if step.note == "rollback" else "update"
            return {"version": step.version}, {"code_applied": (step.version, change, step.note)}
        if kind is StepKind.RESTART:
            ex.restart(spec, ctx)
            return {"machines": machine_names(spec)}, {"restarted": True}
        if kind is StepKind.REPLENISH:
            need = pool_target(self.cfg, spec.topology.num_machines) - len(spec.standbys)
            if need <= 0:
                return {"provisioned": []}, {}
            new = placement.provision(self.cfg.placement, ex, spec, need, ctx)
            out = refilled(spec, new, self.clock())
            self._publish_spec(out)
            return {"provisioned": new, "spec": to_plain(out)}, {}
        if kind is StepKind.QUEUE_UPDATE:
            update = code_update_of(rec.decision)
            assert update is not None
            self.store.request_update(
                rec.job, update.version, rec.decision_id, self.clock(), update.previous, rec.decision.reason
            )
            return {"queued": update.version}, {}
        raise PermanentError(f"no handler for step kind {kind.value}")

    def _pool(
        self, rec: Recovery, spec: JobSpec, leaving: list[str], ctx: StepContext
    ) -> tuple[JobSpec, list[str], dict[str, Any]]:
        """The spec with the operator's offers in its pool, the standbys a swap of ``leaving`` may
        take (never a machine evicted and not offered back since, nor one the job runs on), and
        where they came from (for the step's result)."""
        offered = [o["machine"] for o in self.store.pool_offers(rec.job)]
        excluded = self.store.evicted_machines(rec.job)
        active = set(machine_names(spec)) - set(leaving)
        candidates = [m for m in dict.fromkeys([*spec.standbys, *offered]) if m not in active]
        source: dict[str, Any] = {"from": "spec", "offered": offered}
        probe = getattr(self.executor, "usable_machines", None)
        if StepKind.SWAP_STANDBYS.value in rec.released and callable(probe):
            # An operator released a swap that found no spare: the pool the recovery started with
            # is stale (nodes resumed, drained or added since), so ask the cluster what it has now.
            usable = list(dict.fromkeys(probe(spec, candidates, ctx)))
            fit = set(usable) - active
            source.update(
                {"from": "executor", "usable": usable, "not_usable": [m for m in candidates if m not in fit]}
            )
            candidates = [m for m in dict.fromkeys([*candidates, *usable]) if m in fit]
            spec = replace(spec, standbys=[m for m in candidates if m not in excluded])
            log.info(
                "recovery %s of job %s: the released swap takes its standbys from what %s reports "
                "usable now: %s",
                rec.decision_id,
                rec.job,
                self.executor.name,
                spec.standbys,
            )
        else:
            spec = refilled(spec, candidates, spec.ts_ms)
        source["excluded"] = [m for m in candidates if m in excluded]
        return spec, [m for m in candidates if m not in excluded], source

    def _swap(self, rec: Recovery, spec: JobSpec, machines: list[str], ctx: StepContext) -> dict[str, Any]:
        spec, pool, source = self._pool(rec, spec, machines, ctx)
        ordered, ready = _ready_first(self.executor, spec, pool)
        new: list[str] = []
        if len(ordered) < len(machines):  # §6.2: not enough warm standbys -> provision only the shortfall
            short = len(machines) - len(ordered)
            new = placement.provision(self.cfg.placement, self.executor, spec, short, ctx, machines, ordered)
            spec = refilled(spec, new, spec.ts_ms)
        if len(ordered) + len(new) < len(machines):  # retried: a standby may start or a node free up
            evicted = sorted(self.store.evicted_machines(rec.job))
            raise TemporaryError(
                f"no spare machines for job {rec.job}: {len(machines)} to replace, standbys {ordered}, "
                f"provisioned {new}; evicted machines stay out until returned: {evicted}"
            )
        # Which standby takes which place: the fewest pods per DP/PP group (ready ones first).
        prefer = None if ready is None else ready | set(new)
        pick = placement.pick_standbys(
            self.cfg.placement, self.executor, spec, machines, [*ordered, *new], prefer
        )
        chosen = pick.chosen
        self.executor.activate_standbys(spec, chosen, machines, ctx)
        out = placement.with_positions(swapped(spec, machines, chosen, self.clock()), pick.positions)
        self._publish_spec(out)
        return {
            "spec": to_plain(out),
            "activated": chosen,
            "replaced": machines,
            "provisioned": new,
            "placement": pick.result(self.cfg.placement.alpha, self.cfg.placement.beta),
            "pool": source,
        }

    def _publish_spec(self, spec: JobSpec) -> None:
        try:
            self.publisher.job_spec(spec)
        except Exception as exc:
            raise TemporaryError(f"publishing the new JobSpec failed: {exc}") from exc
        self.store.save_spec(spec)


def _ready_first(executor: Executor, spec: JobSpec, pool: list[str]) -> tuple[list[str], set[str] | None]:
    """``pool`` with the standbys the executor says are ready now first (pool order otherwise),
    and those ready ones (None: the executor cannot tell): a standby still starting (a
    replacement provisioned after the last eviction) is taken only when the ready ones are too
    few -- taking it first made the swap wait seconds for it while a ready one sat idle."""
    probe = getattr(executor, "ready_standbys", None)
    if probe is None or not pool:
        return pool, None
    try:
        ready = set(probe(spec, pool))
    except Exception as exc:  # a failed probe costs the preference, not the swap
        log.warning("executor %s could not tell which standbys are ready: %s", executor.name, exc)
        return pool, None
    return [s for s in pool if s in ready] + [s for s in pool if s not in ready], ready


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _skips(plan: Plan) -> str:
    """``plan``'s skipped rungs as ``skipped replay (why)``, for the recovery's record and event."""
    return _join(*(f"skipped {rung} ({why})" for rung, why in plan.skipped))


def _unconfigured(executor: Executor) -> dict[str, str]:
    """``executor.unconfigured()`` (optional): the methods it cannot perform as configured, and why."""
    probe = getattr(executor, "unconfigured", None)
    if not callable(probe):
        return {}
    gaps = {str(k): str(v) for k, v in dict(probe()).items()}
    for method, why in sorted(gaps.items()):
        log.warning(
            "executor %s cannot %s (%s): recovery rungs needing it are skipped", executor.name, method, why
        )
    return gaps


def _describe(step: Step, result: dict[str, Any]) -> str:
    if step.kind is StepKind.DIAGNOSE:
        return f"failed: {result['failed']}" if result["failed"] else "all tests passed"
    if step.kind is StepKind.SWAP_STANDBYS:
        return _join(
            f"{result['replaced']} -> {result['activated']}", placement.describe(result.get("placement"))
        )
    if step.kind in (StepKind.HOT_UPDATE, StepKind.QUEUE_UPDATE):
        return f"{step.note or 'update'}: {step.version}"
    if step.kind in (StepKind.REPLAY_HORIZONTAL, StepKind.REPLAY_VERTICAL):
        return f"groups ok: {result['ok']}"
    if step.kind is StepKind.REPLENISH:
        return f"provisioned {result.get('provisioned', [])}"
    return ""


#: what an operator must provide when a step of this kind failed for good (the held reason).
_NEEDED: dict[StepKind, str] = {
    StepKind.STOP: "stop the job's processes by hand (the executor could not)",
    StepKind.DIAGNOSE: "a working stop-time test environment on the machines, or cancel and evict by hand",
    StepKind.REPLAY_HORIZONTAL: "machines to run the replay groups on",
    StepKind.REPLAY_VERTICAL: "machines to run the replay groups on",
    StepKind.EVICT: "evict (cordon and drain) the named machines by hand",
    StepKind.SWAP_STANDBYS: (
        "ready standby machines for the evicted ones: start them, resume or add nodes in the "
        "cluster (the released swap asks it again), and put them into the job's pool with "
        "`trainguard actions add-standby --job {job} NODE...` (a healthy node) or "
        "`trainguard actions return-node --job {job} NODE...` (a repaired node it evicted)"
    ),
    StepKind.HOT_UPDATE: "a code version the executor can switch to",
    StepKind.RESTART: "the job restarted on healthy machines (the scheduler refused or failed)",
    StepKind.QUEUE_UPDATE: "a writable action-service state store",
}

#: a crash reported up to this long before a recovery started is covered by that recovery's restart.
_STALE_GRACE_MS = 30_000


def _from_stacks(decision: Decision) -> bool:
    """The decision evicts a group localised by stack aggregation (a hang or fail-slow suspicion),
    not a machine that reported a fault itself."""
    detection = decision.evidence.get("detection")
    return isinstance(detection, dict) and detection.get("kind") == "over_eviction"


def _category(decision: Decision) -> str:
    """The fault category behind ``decision`` (its detection's), else its action."""
    det = decision.evidence.get("detection") if isinstance(decision.evidence, dict) else None
    category = det.get("category") if isinstance(det, dict) else None
    return str(category) if category else decision.action.value


def _source_ms(decision: Decision) -> int | None:
    """Event time of the fault behind ``decision`` (its triggering detection's input)."""
    det = decision.evidence.get("detection") if isinstance(decision.evidence, dict) else None
    ts = det.get("source_ts_ms") if isinstance(det, dict) else None
    return int(ts) if isinstance(ts, int | float) and ts > 0 else None
