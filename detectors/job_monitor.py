"""Per-job training-signal monitoring: NaN/spikes, stalls (hang suspicion), stragglers, MFU decline,
slow data (a loader starving compute).

A :class:`JobMonitor` is fed the job's step telemetry and process exits as they arrive and is
asked periodically (:meth:`JobMonitor.check`) for time-based findings, with an explicit ``now``
so tests and replays control the clock.  A stall is detected from step progress while the rank
processes are alive -- long before an NCCL/gloo timeout would fire.

>>> from trainguard.schemas.workload import TrainingStep
>>> m = JobMonitor("j", MonitorConfig(stall=StallConfig(stall_s=30)))
>>> for r in range(2):
...     _ = m.on_step(TrainingStep(job="j", rank=r, step=1, ts_ms=1000), now_ms=1000)
>>> [d.kind for d in m.on_step(TrainingStep(job="j", rank=0, step=2, ts_ms=2000, loss=float("nan")), 2000)]
['nan']
>>> m.check(now_ms=40_000, stream_now_ms=12_000)  # the worker is 28 s behind its input: no hang
[]
>>> [(d.kind, d.action.value) for d in m.check(now_ms=40_000)]
[('hang', 'aggregate')]
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trainguard.detectors.detections import detection_from_finding
from trainguard.detectors.exit_settle import ExitSettler, SettleConfig
from trainguard.detectors.findings import Finding
from trainguard.detectors.liveness import LivenessConfig, SilentMachineDetector
from trainguard.detectors.log_classifier import classify_exit
from trainguard.detectors.slow_data import SlowDataConfig, SlowDataDetector
from trainguard.detectors.stopped_job import RecoveryStatus, StoppedConfig, StoppedJobDetector
from trainguard.detectors.training import (
    MfuConfig,
    MfuDeclineDetector,
    SpikeConfig,
    SpikeDetector,
    StallConfig,
    StepStallDetector,
    StragglerConfig,
    StragglerDetector,
)
from trainguard.schemas.control import Detection
from trainguard.schemas.enums import Action, ProcessRole, Severity
from trainguard.schemas.workload import ProcessExit, RankLiveness, TrainingStep


@dataclass(frozen=True)
class MonitorConfig:
    """Thresholds of every training-signal detector of a job."""

    spike: SpikeConfig = field(default_factory=SpikeConfig)
    stall: StallConfig = field(default_factory=StallConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    mfu: MfuConfig = field(default_factory=MfuConfig)
    stopped: StoppedConfig = field(default_factory=StoppedConfig)
    settle: SettleConfig = field(default_factory=SettleConfig)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)
    slow_data: SlowDataConfig = field(default_factory=SlowDataConfig)


class JobMonitor:
    """All training-signal detectors of one job, fed from its events."""

    #: the step at which the last hang suspicion was reported (one per stall); class-level
    #: default: a state document written before two-phase detection restores without it.
    _suspect_reported_at_step: int | None = None
    #: rank (as a string: JSON state) -> event time (ms) of its newest step; class-level default
    #: for a state document written before it (see :meth:`on_exit`).
    _rank_step_ms: dict[str, int] | None = None

    def __init__(self, job: str, config: MonitorConfig | None = None) -> None:
        self.job = job
        self.config = config or MonitorConfig()
        self.spike = SpikeDetector(self.config.spike, job=job)
        self.stall = StepStallDetector(self.config.stall, job=job)
        self.straggler = StragglerDetector(self.config.straggler, job=job)
        self.mfu = MfuDeclineDetector(self.config.mfu, job=job)
        self.stopped = StoppedJobDetector(self.config.stopped, job=job)
        self.settle = ExitSettler(self.config.settle)
        self.liveness = SilentMachineDetector(self.config.liveness, job=job)
        # Not in the worker's stored state: after a worker restart it learns its baselines
        # again (a warm-up of each rank's steps), which costs a late slow-data report at most.
        self.slow_data = SlowDataDetector(self.config.slow_data, job=job)
        self.node_of: dict[int, str] = {}
        self.alive: dict[int, bool] = {}
        #: the step at which the last hang was reported: one report per stall, not one per check.
        self._hang_reported_at_step: int | None = None
        self._last_step_ts_ms = 0

    @property
    def last_step_ts_ms(self) -> int:
        """When the newest step of the job (any rank) was taken."""
        return self._last_step_ts_ms

    def on_step(self, e: TrainingStep, now_ms: int) -> list[Detection]:
        self.node_of[e.rank] = e.node or self.node_of.get(e.rank, "")
        self.alive[e.rank] = True
        if self._rank_step_ms is None:
            self._rank_step_ms = {}
        key = str(e.rank)
        self._rank_step_ms[key] = max(self._rank_step_ms.get(key, e.ts_ms), e.ts_ms)
        ts = e.ts_ms / 1000
        self.stall.update(e.rank, e.step, ts, e.step_time_s)
        if e.node:
            self.liveness.step(e.node, ts)
        self.stopped.update(e.rank, e.step, ts)
        self._last_step_ts_ms = max(self._last_step_ts_ms, e.ts_ms)
        if e.step_time_s is not None:
            self.straggler.observe(e.rank, e.step_time_s, ts, step=e.step)
        findings: list[Finding] = []
        values = {k: v for k, v in (("loss", e.loss), ("grad_norm", e.grad_norm)) if v is not None}
        for f in self.spike.observe(ts, values, step=e.step, source=e.rank):
            findings.append(_with(f, ranks=(e.rank,), node=e.node))
        if e.mfu is not None and e.rank == 0 and (f2 := self.mfu.observe(ts, e.mfu)) is not None:
            findings.append(f2)
        if e.data_wait_s is not None:
            f3 = self.slow_data.observe(e.rank, e.step, ts, e.step_time_s, e.data_wait_s, node=e.node)
            if f3 is not None:
                findings.append(f3)
        return [self._det(f, e.ts_ms, now_ms, ("step", e.rank, e.step)) for f in findings]

    def on_liveness(self, e: RankLiveness) -> list[Detection]:
        """A node's word on the job's ranks there (judged in :meth:`check`, against the clock)."""
        self.liveness.liveness(e.node, e.ranks, e.ts_ms / 1000, e.interval_s)
        for r in e.ranks:
            self.node_of.setdefault(r, e.node)
        return []

    def on_exit(self, e: ProcessExit, now_ms: int) -> list[Detection]:
        stepped_since = (self._rank_step_ms or {}).get(str(e.rank), -1) > e.ts_ms
        if e.role is ProcessRole.MAIN and e.rank >= 0 and not stepped_since:
            # An exit older than the rank's newest step is an earlier process's: the exits and the
            # steps come on different topics, and one that arrived after the restarted rank's
            # first steps marked the live rank dead for good -- so no hang was ever reported
            # when it was stopped next (measured: bench/own_job.py, a SIGSTOP 15 s after a
            # restart, the job left stalled).
            self.alive[e.rank] = False
            # None: ended with its status unseen (the exporter's word on a process it did not start).
            self.stopped.on_exit(e.rank, -e.signal if e.signal else e.exit_code)
        c = classify_exit(e.exit_code, e.signal, e.traceback or None)
        finding = c.to_finding(job=self.job, node=e.node)
        if finding is None:
            return []
        if e.role is ProcessRole.DATALOADER and finding.action is not Action.IGNORE:
            # A DataLoader worker's death is answered by its rank: torch raises in the main
            # process (whose exit, with the traceback, is classified) or the rank's shadow loader
            # takes over and kills the hung lane's workers itself; the kernel's OOM-kill line has
            # its own row.  Acting on the worker's exit too restarted jobs that trained on.
            note = "a DataLoader worker's exit: recorded; its rank's main process answers it"
            evidence = {
                **finding.evidence,
                "recommended": finding.action.value,
                "role": e.role.value,
                "note": note,
            }
            finding = replace(finding, action=Action.IGNORE, severity=Severity.WARNING, evidence=evidence)
        if e.rank >= 0:
            finding = _with(finding, ranks=(e.rank,), node=e.node)
        # A peer's collective error waits briefly for the exit that caused it (exit_settle).
        return self.settle.offer(self._det(finding, e.ts_ms, now_ms, ("exit", e.node, e.pid)), now_ms)

    def check(
        self, now_ms: int, stream_now_ms: int | None = None, recoveries: RecoveryStatus | None = None
    ) -> list[Detection]:
        """Time-based findings: a stall (reported once per stalled step), stragglers, and a stopped
        job (judged against ``recoveries``, what the action service says of the job; without it
        the job is taken to have no recovery at work).

        ``stream_now_ms`` is how far the input stream has got (:class:`~trainguard.detectors.windows.
        StreamClock`): progress is judged against it, so a consumer that lags does not take
        every job for stalled; detections are still stamped with ``now_ms``."""
        now = now_ms / 1000
        out = self.settle.release(now_ms)  # secondary exits whose root cause never came
        stream_now = (stream_now_ms if stream_now_ms is not None else now_ms) / 1000
        status = recoveries or RecoveryStatus()
        progress_ts = self.stall.last_progress()
        if progress_ts is not None:
            status.progressed(progress_ts)  # a hold the job has trained past is over
        # A job a recovery is stopping, restarting or holding makes no progress on purpose; after
        # it, the stall is counted from the recovery's end, not from the last step before it.
        busy = status.busy(stream_now, self.config.stopped.recovery_silence_s)
        # A machine that fell silent while the job stopped: evict it now, without a capture that
        # would only wait out its deadline on the silent machine's ranks.
        progress = self.stall.last_progress()
        if progress is not None and status.last_stop_end is not None:
            progress = max(progress, status.last_stop_end)
        since = status.last_stop_end
        silent = None if busy else self.liveness.check(stream_now, progress, since)
        if silent is not None:
            heard_ms = int(min(v["last_heard_s"] for v in silent.evidence["silent"].values()) * 1000)
            out.append(self._det(silent, heard_ms, now_ms, ("silent", heard_ms)))
        # While a reported silent machine explains the stall, it is not a hang to capture.
        explained = bool(self.liveness.reported & set(self.liveness.silent(stream_now, since)))
        hang = (
            None
            if busy or explained
            else self.stall.check(stream_now, alive=self.alive or None, since=status.last_stop_end)
        )
        if hang is not None:
            max_step = int(hang.evidence["max_step"])
            if hang.kind == "hang_suspect":
                if max_step not in (self._suspect_reported_at_step, self._hang_reported_at_step):
                    self._suspect_reported_at_step = max_step
                    # The capture's verdict waits until then (wall clock: the aggregation's).
                    confirm_ms = now_ms + int(float(hang.evidence["confirm_in_s"]) * 1000)
                    hang = replace(hang, evidence={**hang.evidence, "confirm_at_ms": confirm_ms})
                    out.append(self._det(hang, self._last_step_ts_ms, now_ms, ("hang_suspect", max_step)))
            elif self._hang_reported_at_step != max_step:
                self._hang_reported_at_step = max_step
                # Keyed by the stalled step: re-checking the same stall yields the same id.
                out.append(self._det(hang, self._last_step_ts_ms, now_ms, ("hang", max_step)))
        stopped = self.stopped.check(stream_now, status)
        if stopped is not None:
            quiet_ms = int((stream_now - float(stopped.score or 0)) * 1000)
            out.append(self._det(stopped, quiet_ms, now_ms, ("stopped", quiet_ms)))
        slow = self.straggler.check(now)
        if slow is not None:
            bucket = now_ms // 60_000 * 60_000  # at most one straggler detection a minute
            out.append(self._det(slow, bucket, now_ms, ("straggler", bucket)))
        return out

    def _det(self, f: Finding, source_ts_ms: int, now_ms: int, key: object) -> Detection:
        node = f.node or (self.node_of.get(f.ranks[0], "") if len(f.ranks) == 1 else "")
        return detection_from_finding(
            f, job=self.job, node=node, source_ts_ms=source_ts_ms, now_ms=now_ms, source_key=key
        )


def _with(f: Finding, *, ranks: tuple[int, ...], node: str) -> Finding:
    return replace(f, ranks=ranks, node=node or f.node)
