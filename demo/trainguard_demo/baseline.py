"""The BASELINE policy: what a team without TrainGuard has -- a fixed no-progress timeout, then a
cold requeue of the whole job from its last periodic checkpoint.

The demo runs the same fault scenario on a second job under this policy and computes its ETTR the
same way as TrainGuard's (from the step telemetry in ClickHouse), so the two numbers compare a
policy, not a measurement.  :class:`BaselineSupervisor` runs in a background thread:

1. **launch** the job cold (:func:`~trainguard_demo.launcher.launch_job`) with periodic
   checkpoints (``checkpoint_every``, default 50 steps, instead of TrainGuard's every step) and
   ``nan_check`` (Megatron's ``check_for_nan_in_loss_and_grad``: a NaN loss raises, so it ends in
   a crash a timeout can see, instead of training on silently);
2. **detect** only by a timeout: every ``poll_s`` it reads the ranks' progress files; the job's
   progress is the minimum step over the ranks of the current launch (:class:`StallClock`).  If it
   has not advanced for ``timeout_s``, the job is declared dead.  It looks at nothing else: no
   telemetry, no logs, no exit codes -- a crashed rank just stops progressing (its peers block in
   gloo), exactly like a hang;
3. **requeue**: stop every rank (SIGKILL), clear the machines' fault hooks (a requeue lands on a
   fresh allocation, so a persistent machine fault is gone), and relaunch every rank cold (new
   processes, torch imported again, a new rendezvous port ``port_base + n``) resuming from the
   latest complete checkpoint: the steps since it are lost and recomputed;
4. **user-code errors**: there is no automatic rollback, but operators eventually revert a
   crash-looping push: after ``rollback_after_failures`` consecutive launches that made no step
   beyond their resume step, the cluster's code version is rolled back
   (:func:`trainguard_demo.codever.rollback`) before the next relaunch.

Every incident is recorded (:meth:`BaselineSupervisor.incidents`): ``stalled_since`` (the last
observed progress; the launch, if that launch never got past its resume step), ``detected_at``
(the timeout fired), ``requeued_at`` (the new ranks were started), ``resumed_at`` (the job's
minimum step first passed the resume step again), the steps lost, the code rollback if any.
Times are wall clock (``time.time()``), like the telemetry.

Honest modelling choices (most of them in the baseline's favour):

* The timeout is scaled down with the job (30 s against production's 10-30 min NCCL/watchdog
  timeouts; ByteRobust §3.3): the baseline detects hangs far faster than real ones would.
* Crashes are also seen only through the timeout (the brief's baseline does not watch exits).
  A scheduler that requeues on a process exit would see a crash sooner; the short timeout is the
  stand-in for that plus the time to notice and requeue.
* The requeue has no scheduling delay by default (``requeue_delay_s``), always gets healthy
  machines (faults cleared), and reloads checkpoints from the same local disks TrainGuard uses,
  not from slow remote storage: in production each of these costs minutes (§3.3: "often more than
  10 minutes" per failover).
* Fail-slow ranks and loss spikes are never detected (the job still progresses): the baseline
  simply pays the lower throughput, as a team without monitoring would.
* The no-progress timer of a launch starts once the job is up again: every rank of the launch
  has done a step past the resume step.  Until then ``startup_timeout_s`` (from the launch)
  applies, as production watchdogs allow for a cold start (scheduling, imports, rendezvous,
  checkpoint load) far longer than their hang timeout; on 2 shared cores a cold start of 8 ranks
  can take longer than ``timeout_s`` itself, and a shorter limit would requeue forever.  The
  price: a push that crashes every launch before its first step is seen after
  ``startup_timeout_s``, not ``timeout_s``.
* Progress records carry the writer's pid, so only records of the current launch's processes
  count: stale files from killed ranks are neither progress nor a stall.
* Run the baseline job in its own ``cluster_dir``: it clears the fault hooks of its machines and
  rolls back that cluster's code version.

>>> clock = StallClock(timeout_s=5, startup_timeout_s=60)
>>> clock.reset(now=0.0)
>>> clock.observe(None, 30.0), clock.observe(6, 31.0), clock.observe(7, 33.0), clock.observe(7, 37.9)
(False, False, False, False)
>>> clock.observe(7, 38.0), clock.best, clock.since
(True, 7, 33.0)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from trainguard_demo import codever
from trainguard_demo.checkpoint import latest_complete
from trainguard_demo.config import LaunchSpec
from trainguard_demo.faults import clear_faults
from trainguard_demo.launcher import JobHandle, launch_job, read_progress, stop_job

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BaselineConfig:
    """Settings of the baseline policy (see the module docstring)."""

    #: rendezvous ports: launch n (0 = the first) uses ``port_base + n``.
    port_base: int
    #: no progress for this long after the job is up: declared dead, requeued.
    timeout_s: float = 30.0
    #: the baseline job's checkpoint period in steps (TrainGuard's job checkpoints every step).
    checkpoint_every: int = 50
    poll_s: float = 1.0
    #: consecutive launches without a step past their resume step before operators revert the code.
    rollback_after_failures: int = 2
    #: how long a launch may take until every rank has done a step past the resume step (a cold
    #: start: torch imports, rendezvous, checkpoint load); then ``timeout_s`` applies.
    startup_timeout_s: float = 90.0
    #: wait between stopping the ranks and relaunching them (a scheduler's queueing delay).
    requeue_delay_s: float = 0.0
    #: the CPUs the baseline's ranks are pinned to (empty: not pinned), apart from the CPUs of
    #: TrainGuard's job when both run on one host (:func:`~trainguard_demo.launcher.cluster_cpus`).
    cpus: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.poll_s <= 0 or self.startup_timeout_s <= 0:
            raise ValueError("timeout_s, poll_s and startup_timeout_s must be > 0")
        if self.checkpoint_every < 1 or self.rollback_after_failures < 1:
            raise ValueError("checkpoint_every and rollback_after_failures must be >= 1")
        if self.requeue_delay_s < 0:
            raise ValueError("requeue_delay_s must be >= 0")


class StallClock:
    """The baseline's only detector: a no-progress timer over the job's (minimum) step.

    :meth:`reset` at each launch; :meth:`observe` every poll with the job's step (``None`` until
    the job is up: every rank has done a step of this launch) returns True once the step has not
    advanced for ``timeout_s`` -- or, before the job is up, once ``startup_timeout_s`` has passed
    since the launch.
    """

    def __init__(self, timeout_s: float, startup_timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.startup_timeout_s = timeout_s if startup_timeout_s is None else startup_timeout_s
        #: the highest step seen since the launch (None: not up yet).
        self.best: int | None = None
        #: when the step last advanced (or the launch, before the job is up).
        self.since = 0.0

    @property
    def started(self) -> bool:
        return self.best is not None

    def reset(self, now: float) -> None:
        self.best, self.since = None, now

    def observe(self, step: int | None, now: float) -> bool:
        """Record the job's step at ``now``; True when the timeout has run out."""
        if step is not None and (self.best is None or step > self.best):
            self.best, self.since = step, now
        limit = self.timeout_s if self.started else self.startup_timeout_s
        return now - self.since >= limit


def _current(
    progress: Mapping[int, Mapping[str, Any]], pids: Mapping[int, int]
) -> list[Mapping[str, Any]] | None:
    """The records of the launch whose rank -> pid is ``pids``; None until every rank has one."""
    recs = [progress.get(rank) for rank in pids]
    if any(r is None or r.get("pid") != pids[rank] for rank, r in zip(pids, recs, strict=True)):
        return None
    return [r for r in recs if r is not None]


def generation_step(progress: Mapping[int, Mapping[str, Any]], pids: Mapping[int, int]) -> int | None:
    """The job's progress: the minimum step over the ranks (rank -> pid of this launch's process);
    None until every rank's current process has written its record.

    >>> generation_step({0: {"pid": 10, "step": 5}, 1: {"pid": 11, "step": 4}}, {0: 10, 1: 11})
    4
    >>> generation_step({0: {"pid": 10, "step": 5}, 1: {"pid": 9, "step": 40}}, {0: 10, 1: 11}) is None
    True
    """
    recs = _current(progress, pids)
    return None if recs is None else min(int(r.get("step", 0)) for r in recs)


def generation_done(progress: Mapping[int, Mapping[str, Any]], pids: Mapping[int, int]) -> bool:
    """True when every rank of the launch reported ``done`` (the job finished: no requeue)."""
    recs = _current(progress, pids)
    return recs is not None and all(r.get("status") == "done" for r in recs)


def _resume_step(spec: LaunchSpec) -> int:
    found = latest_complete(spec)
    return found[0] if found else 0


class BaselineSupervisor:
    """Runs ``spec`` under the baseline policy in a background thread (see the module docstring).

    .. code-block:: python

        sup = BaselineSupervisor(spec, BaselineConfig(port_base=29800)).start()
        ...                         # inject faults into spec.cluster_dir's machines
        sup.wait(timeout=600)       # True once the job finished
        sup.stop()                  # stops the thread and kills the ranks
        sup.incidents()             # [{detected_at, requeued_at, resumed_at, stalled_since, ...}]
    """

    def __init__(
        self, spec: LaunchSpec, config: BaselineConfig, clock: Callable[[], float] = time.time
    ) -> None:
        self.config = config
        #: the job as the baseline runs it (every launch differs only in ``master_port``).
        self.base = replace(spec, checkpoint_every=config.checkpoint_every, nan_check=True, resume=True)
        self._now = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None
        self._spec = self.base
        self._handle: JobHandle | None = None
        self._launches = 0
        self._stall = StallClock(config.timeout_s, config.startup_timeout_s)
        self._resume = 0  # the step the current launch resumes from
        self._no_progress = 0  # consecutive launches that made no step past their resume step
        self._incidents: list[dict[str, Any]] = []
        self._finished_at: float | None = None

    # -- state (thread-safe) -----------------------------------------------------------------
    @property
    def spec(self) -> LaunchSpec:
        """The current launch's spec (its ``master_port`` changes with every requeue)."""
        with self._lock:
            return self._spec

    @property
    def handle(self) -> JobHandle | None:
        with self._lock:
            return self._handle

    @property
    def requeues(self) -> int:
        with self._lock:
            return len(self._incidents)

    @property
    def finished_at(self) -> float | None:
        with self._lock:
            return self._finished_at

    def incidents(self) -> list[dict[str, Any]]:
        """A copy of every incident so far, oldest first (see the module docstring for the keys)."""
        with self._lock:
            return [dict(i) for i in self._incidents]

    def finished(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job finished or ``timeout`` passed; True if it finished."""
        return self._finished.wait(timeout)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, background: bool = True) -> BaselineSupervisor:
        """Launch the job cold and (``background``) start polling it every ``poll_s``."""
        if self._handle is not None:
            raise RuntimeError("the baseline supervisor was already started")
        self._launch()
        if background:
            self._thread = threading.Thread(target=self._run, name=f"baseline-{self.base.job}", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop polling and kill every rank of the current launch."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        handle = self.handle
        if handle is not None:
            stop_job(handle, grace_s=0.0)

    def _run(self) -> None:
        while not self._stop.wait(self.config.poll_s) and not self._finished.is_set():
            try:
                self.tick()
            except Exception:  # a torn progress file, a failed launch: log, retry next poll
                log.exception("baseline %s: poll failed", self.base.job)

    # -- the policy --------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        """One poll: read progress, requeue on a timeout, note a resume (the thread calls this)."""
        if self._finished.is_set() or self._handle is None:
            return
        now = self._now() if now is None else now
        spec, handle = self.spec, self._handle
        progress = read_progress(spec)
        pids = {p.rank: p.pid for p in handle.procs}
        if generation_done(progress, pids):
            with self._lock:
                self._finished_at = now
            self._finished.set()
            log.info(
                "baseline %s: finished at step %d after %d requeues", spec.job, spec.steps, self.requeues
            )
            return
        step = generation_step(progress, pids)
        up = step is not None and step > self._resume  # every rank did a step of this launch
        if self._stall.observe(step if up else None, now):
            self._requeue(now)
            return
        if up:
            with self._lock:
                last = self._incidents[-1] if self._incidents else None
                if last is not None and last["resumed_at"] is None and last["requeued_at"] is not None:
                    last["resumed_at"] = now
                    log.info(
                        "baseline %s: resumed past step %d, %.1fs after detection",
                        spec.job, self._resume, now - last["detected_at"],
                    )  # fmt: skip

    def _launch(self) -> None:
        resume = _resume_step(self.base)
        spec = replace(self.base, master_port=self.config.port_base + self._launches)
        handle = launch_job(spec, cpus=self.config.cpus)  # its own CPUs, never the other job's
        with self._lock:
            self._spec, self._handle = spec, handle
            self._launches += 1
        self._resume = resume
        self._stall.reset(self._now())
        log.info("baseline %s: launched (port %d), resuming from step %d", spec.job, spec.master_port, resume)

    def _requeue(self, now: float) -> None:
        spec, handle = self.spec, self._handle
        stalled_step = self._stall.best  # None: the launch never got past its resume step
        self._no_progress = 0 if stalled_step is not None else self._no_progress + 1
        incident: dict[str, Any] = {
            "n": self.requeues + 1, "job": spec.job,
            "stalled_since": self._stall.since, "detected_at": now,
            "requeued_at": None, "resumed_at": None,
            "stalled_step": stalled_step, "previous_resume_step": self._resume,
            "resume_step": None, "lost_steps": None, "master_port": None, "rollback": None,
        }  # fmt: skip
        with self._lock:
            self._incidents.append(incident)
        log.warning(
            "baseline %s: no progress for %.1fs (step %s): requeueing the whole job",
            spec.job, now - self._stall.since, stalled_step,
        )  # fmt: skip
        if handle is not None:
            stop_job(handle, grace_s=0.0)
        for machine in spec.machine_names():  # a fresh allocation: no machine fault follows the job
            clear_faults(spec.cluster_dir, machine)
        rollback = None
        if self._no_progress >= self.config.rollback_after_failures:
            before = codever.current_version(spec.cluster_dir)
            after = codever.rollback(spec.cluster_dir)
            rollback = f"{before}->{after}" if after != before else None
            log.warning(
                "baseline %s: %d requeues without progress: operators revert the code (%s)",
                spec.job, self._no_progress, rollback or "nothing to revert",
            )  # fmt: skip
            self._no_progress = 0
        if self.config.requeue_delay_s:
            self._stop.wait(self.config.requeue_delay_s)
        self._launch()
        with self._lock:
            incident.update(
                requeued_at=self._now(), resume_step=self._resume, master_port=self._spec.master_port,
                lost_steps=max(0, (stalled_step or incident["previous_resume_step"]) - self._resume),
                rollback=rollback,
            )  # fmt: skip
