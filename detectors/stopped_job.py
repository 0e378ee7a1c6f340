"""Stopped-job detection: a job that neither trains, nor is being recovered, nor waits for an operator.

Every other detector reacts to something a job *does* (an exit, a NaN, a stall while its ranks
live).  A job can also end up doing nothing at all: a recovery stopped it and then failed, the
scheduler dropped it, or its ranks died without a trace anyone classified.  ByteRobust's rule is
that such a job is itself an incident, so this detector watches the absence of progress against
what the action service says it is doing (its ``control.actions`` events):

* a recovery of the job that is still running (an event within ``recovery_silence_s``), or one
  held for an operator, explains the silence: nothing is reported;
* otherwise, ``stopped_s`` after the later of the last step and the last recovery's end, a
  ``stopped`` finding recommends ``restart`` -- if some rank is known dead (a live-but-stuck job
  is the hang detector's case), or after ``stopped_s`` more if every rank still looks alive;
* a job whose ranks all exited with code 0 finished: it is not stopped.

It is reported once per quiet period (the key is the time the quiet began), so a restart that
brings no step back is reported again ``stopped_s`` after that restart ended.

>>> d = StoppedJobDetector(StoppedConfig(stopped_s=60), job="j")
>>> d.update(0, 100, ts=0.0); d.update(1, 100, ts=0.0)
>>> d.on_exit(1, exit_code=-9)
>>> recoveries = RecoveryStatus()
>>> recoveries.observe("d1", "recovery", "started", ts=5.0)
>>> d.check(70.0, recoveries) is None  # recovery d1 is running
True
>>> recoveries.observe("d1", "recovery", "failed", ts=20.0)
>>> d.check(70.0, recoveries) is None  # 50 s since the recovery failed
True
>>> f = d.check(81.0, recoveries)
>>> f.kind, f.action.value, f.evidence["last_recovery"]
('stopped', 'restart', 'd1')
>>> d.check(90.0, recoveries) is None  # reported once
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainguard.detectors.findings import Finding
from trainguard.schemas.enums import Action, Severity
from trainguard.schemas.typecheck import bounds

#: recovery-level phases that end a recovery (the ``recovery`` step's events).
_ENDS = frozenset({"succeeded", "failed"})
#: recovery steps that stop the job's ranks: the job makes no progress until the recovery ends.
STOPPING_STEPS = frozenset({"stop", "evict", "restart"})


@dataclass(frozen=True)
class StoppedConfig:
    """Settings of :class:`StoppedJobDetector`."""

    #: no step and no recovery at work for this long (with a rank dead) is a stopped job.
    stopped_s: float = field(default=300.0, metadata=bounds(1.0, 1e7))
    #: a recovery with no action event for this long is taken for gone (its service died).
    recovery_silence_s: float = field(default=900.0, metadata=bounds(1.0, 1e7))


class RecoveryStatus:
    """What the action service's events say about one job's recoveries (fed from ``control.actions``)."""

    def __init__(self) -> None:
        #: decision id -> time of its latest event, for recoveries that have not ended.
        self.open: dict[str, float] = {}
        self.held: set[str] = set()
        #: the latest end of a recovery (succeeded or failed), and which one it was.
        self.last_end: float | None = None
        self.last_id = ""
        self.last_state = ""

    #: the end of the latest recovery that stopped the job's ranks (:data:`STOPPING_STEPS`): a
    #: stall is counted from it.  Not any recovery's end: a stream of no-op recoveries (a flapping
    #: NIC tolerated every few seconds) would otherwise postpone a hang forever.  Class-level
    #: defaults: a state document written before these existed restores without them.
    last_stop_end: float | None = None
    #: open recoveries that ran a stopping step.
    stopping: frozenset[str] = frozenset()

    def observe(self, decision_id: str, step: str, phase: str, ts: float) -> None:
        """Record one action event (``step`` is ``recovery`` for the recovery's own events)."""
        if step == "recovery" and phase in _ENDS:
            self.open.pop(decision_id, None)
            self.held.discard(decision_id)
            if self.last_end is None or ts >= self.last_end:
                self.last_end, self.last_id, self.last_state = ts, decision_id, phase
            if decision_id in self.stopping:
                self.stopping = self.stopping - {decision_id}
                self.last_stop_end = ts if self.last_stop_end is None else max(self.last_stop_end, ts)
            return
        if step in STOPPING_STEPS:
            self.stopping = self.stopping | {decision_id}
        if phase == "held":
            self.held.add(decision_id)
        else:
            self.held.discard(decision_id)  # released: its steps run again
        self.open[decision_id] = max(ts, self.open.get(decision_id, ts))
        self.last_id = decision_id

    def busy(self, now: float, silence_s: float) -> bool:
        """A recovery is at work (an event within ``silence_s``) or waits for an operator."""
        return bool(self.held) or any(now - ts < silence_s for ts in self.open.values())

    def progressed(self, ts: float) -> list[str]:
        """The job trained at ``ts``: a recovery held before that is over (someone restarted the
        job: an operator, a new run of the same name); forget it and return its id.

        Without this a hold never released by hand kept the job "busy" for as long as its
        events are read back (a day), and every later stall of a job of that name went
        unreported (measured: a run of bench/own_job.py held at its first fault; the next runs
        of the same job name left a SIGSTOPped rank's job stalled with no decision).

        >>> r = RecoveryStatus()
        >>> r.observe("d1", "stop", "held", ts=10.0)
        >>> r.busy(20.0, 240.0), r.progressed(5.0), r.busy(20.0, 240.0)
        (True, [], True)
        >>> r.progressed(30.0), r.busy(40.0, 240.0)
        (['d1'], False)
        """
        over = sorted(d for d in self.held if self.open.get(d, -math.inf) < ts)
        for d in over:
            self.held.discard(d)
            self.open.pop(d, None)
            self.stopping = self.stopping - {d}
        return over


class StoppedJobDetector:
    """Raises ``stopped`` for a job with no progress, no recovery at work and no hold."""

    def __init__(self, config: StoppedConfig | None = None, job: str | None = None) -> None:
        self.config = config or StoppedConfig()
        self.job = job
        self._step: dict[int, int] = {}
        self._last_progress: float | None = None
        #: rank -> exit code of its last exit (absent: running, as far as anyone reported).
        self._exits: dict[int, int] = {}
        self._reported_quiet_since: float | None = None

    def update(self, rank: int, step: int, ts: float) -> None:
        """``rank`` reported ``step`` at ``ts``: a changed step is progress (a restart from a
        checkpoint recomputes lower steps), and the rank lives."""
        self._exits.pop(rank, None)
        if rank not in self._step or step != self._step[rank]:
            self._step[rank] = step
            self._last_progress = ts if self._last_progress is None else max(self._last_progress, ts)

    def on_exit(self, rank: int, exit_code: int | None) -> None:
        """``rank``'s process ended with ``exit_code``; None: its status was not seen, which counts
        as a failure unless a report of the same run said it (the launcher and the rank's own
        reporter see the status; the exporter, noticing the process gone later, does not)."""
        if rank >= 0 and (exit_code is not None or rank not in self._exits):
            self._exits[rank] = 1 if exit_code is None else exit_code

    def finished(self) -> bool:
        """Every rank that ever reported exited cleanly (the job is done, not stopped)."""
        return bool(self._step) and all(self._exits.get(r) == 0 for r in self._step)

    def check(self, now: float, recoveries: RecoveryStatus) -> Finding | None:
        """A ``stopped`` finding, or None (see the module docstring for the rule)."""
        cfg = self.config
        if self._last_progress is None or self.finished():
            return None
        if recoveries.busy(now, cfg.recovery_silence_s):
            return None
        quiet_since = max(self._last_progress, recoveries.last_end or self._last_progress)
        quiet = now - quiet_since
        some_dead = any(code != 0 for code in self._exits.values())
        if quiet < cfg.stopped_s or (not some_dead and quiet < 2 * cfg.stopped_s):
            return None
        if self._reported_quiet_since == quiet_since:
            return None
        self._reported_quiet_since = quiet_since
        return Finding(
            kind="stopped",
            category="job_stopped",
            severity=Severity.ERROR,
            action=Action.RESTART,
            job=self.job,
            ranks=tuple(sorted(r for r, code in self._exits.items() if code != 0)),
            score=quiet,
            evidence={
                "last_step": max(self._step.values()),
                "stopped_for_s": round(quiet, 1),
                "dead_ranks": sorted(r for r, code in self._exits.items() if code != 0),
                "last_recovery": recoveries.last_id,
                "last_recovery_state": recoveries.last_state,
            },
            ts=now,
        )
