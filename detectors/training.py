"""Training-signal detectors: NaN/spikes, step stalls, step-time stragglers and MFU decline.

These are ByteRobust's implicit-failure signals (§4.1, "metrics collection"): a NaN or a
5x jump of loss or gradient norm is a fault signal; no progress while every process is alive
is a hang suspicion; one rank slower than its peers, or the job's MFU sinking below its own
baseline, is a fail-slow suspicion.  Hangs and fail-slows recommend ``aggregate`` (stack
aggregation and over-eviction); NaN and spikes recommend ``diagnose`` (stop-time checks).

Every detector is fed explicit timestamps and never reads the clock; each has a frozen config
dataclass loadable with :func:`trainguard.schemas.config.load_config`.  Non-numeric or non-finite input
that is not itself the signal (a garbage step time, an MFU of ``"n/a"``) is ignored, not raised.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainguard.detectors.findings import Finding
from trainguard.schemas.enums import Action, Severity
from trainguard.schemas.typecheck import bounds


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


# --- NaN / Inf and spikes --------------------------------------------------------------------


@dataclass(frozen=True)
class SpikeConfig:
    """Settings of :class:`SpikeDetector`."""

    #: a value >= factor x the recent median is a spike (ByteRobust: 5x).
    factor: float = field(default=5.0, metadata=bounds(1.0, 1e6))
    #: how many recent accepted values form the median.
    window: int = field(default=50, metadata=bounds(1, 100_000))
    #: values needed before spikes are judged (NaN/Inf are reported from the first one).
    warmup: int = field(default=10, metadata=bounds(1, 100_000))
    #: after this many spikes in a row the level is taken as the new normal (baseline restarts).
    max_consecutive: int = field(default=20, metadata=bounds(1, 100_000))
    #: and a spike must also rise this much above the median in absolute terms: a loss that has
    #: converged to the noise floor (1e-5) jumps "5x" on an ordinary batch (measured: a small DDP
    #: job at 7.5e-6 read 4.2e-5 as a spike); an LLM's loss spike is whole units.
    min_delta: float = field(default=1e-3, metadata=bounds(0.0, 1e9))


class SpikeDetector:
    """NaN/Inf and jump detection on loss, grad norm or any other positive training metric.

    Spikes never enter the baseline, so a burst of them cannot raise the median and hide itself.

    Examples
    --------
    >>> d = SpikeDetector(SpikeConfig(warmup=3), job="j")
    >>> [d.observe(float(i), {"loss": 2.0}) for i in range(3)]
    [[], [], []]
    >>> [(f.kind, f.evidence["metric"], round(f.score, 1)) for f in d.observe(3.0, {"loss": 11.0})]
    [('spike', 'loss', 5.5)]
    >>> [(f.kind, f.action.value) for f in d.observe(4.0, {"grad_norm": float("nan")})]
    [('nan', 'diagnose')]
    """

    def __init__(self, config: SpikeConfig | None = None, job: str | None = None) -> None:
        self.config = config or SpikeConfig()
        self.job = job
        self._recent: dict[str, deque[float]] = {}
        self._streak: dict[str, int] = {}
        #: the last step number seen from each source (a rank), as a string key (JSON state).
        self._last_steps: dict[str, int] = {}

    def observe(
        self, ts: float, values: Mapping[str, Any], step: int | None = None, source: object = None
    ) -> list[Finding]:
        """Feed one step's metrics (``{"loss": 2.3, "grad_norm": 1.1}``) of one ``source`` (a rank);
        return findings.

        A source's step number lower than its last one is a restart that resumed from an earlier
        checkpoint: the job does those steps again, and their loss is the loss of that point of
        the training, not a spike over the later steps' median.  The baselines start again there
        (measured: a DDP job resumed from its snapshot two epochs back read as a 5x loss spike on
        the healthy replacement node).  Ranks a step apart are not a restart: each is compared
        with its own last step.

        >>> d = SpikeDetector(SpikeConfig(warmup=3))
        >>> [d.observe(float(i), {"loss": 1.0}, step=100 + i, source=0) for i in range(3)]
        [[], [], []]
        >>> d.observe(3.0, {"loss": 9.0}, step=40, source=0)  # resumed at step 40
        []
        """
        if step is not None:
            # getattr: a detector restored from a changelog written before this attribute.
            last_steps = getattr(self, "_last_steps", None)
            if last_steps is None:
                last_steps = self._last_steps = {}
            key = str(source)
            if key in last_steps and step < last_steps[key]:
                self._recent.clear()
                self._streak.clear()
                last_steps.clear()
            last_steps[key] = step
        out = []
        for metric, raw in values.items():
            if isinstance(raw, bool) or not isinstance(raw, int | float):
                continue  # garbage, not a signal
            value = float(raw)
            evidence: dict[str, Any] = {"metric": metric, "value": repr(value), "step": step}
            if not math.isfinite(value):
                out.append(self._finding("nan", "nan_value", Severity.ERROR, None, evidence, ts))
                continue
            recent = self._recent.setdefault(metric, deque(maxlen=self.config.window))
            if len(recent) >= self.config.warmup:
                median = statistics.median(recent)
                jump = value >= self.config.factor * median and value - median >= self.config.min_delta
                if median > 0 and jump:
                    streak = self._streak.get(metric, 0) + 1
                    self._streak[metric] = streak
                    if streak >= self.config.max_consecutive:
                        recent.clear()  # a regime change, not a spike: learn the new level
                        self._streak[metric] = 0
                    evidence.update(value=value, median=median, factor=value / median)
                    out.append(
                        self._finding(
                            "spike", f"{metric}_spike", Severity.WARNING, value / median, evidence, ts
                        )
                    )
                    continue
            self._streak[metric] = 0
            recent.append(value)
        return out

    def _finding(
        self, kind: str, category: str, sev: Severity, score: float | None, ev: dict[str, Any], ts: float
    ) -> Finding:
        return Finding(kind, category, sev, Action.DIAGNOSE, job=self.job, score=score, evidence=ev, ts=ts)


# --- step stall (hang suspicion) ---------------------------------------------------------------


@dataclass(frozen=True)
class StallConfig:
    """Settings of :class:`StepStallDetector`.

    The threshold follows the job's own step time: ``step_time_factor`` x the
    ``step_time_quantile`` of its recent step times, never below ``min_stall_s`` and never above
    ``stall_s``.  A job stepping every second is called hung after ``min_stall_s`` (10 s by
    default), one stepping every minute after about five minutes -- where a fixed threshold is
    either an NCCL timeout late for the first or a false alarm for the second.  Until
    ``min_step_samples`` step times are known (a job's first steps), and with
    ``step_time_factor = 0``, the threshold is ``stall_s``.
    """

    #: the longest a job may make no progress: the cap of the derived threshold and the threshold
    #: until the job's step time is known.  Keep it well under the collective (NCCL) timeout.
    stall_s: float = field(default=600.0, metadata=bounds(1.0, 1e7))
    #: the derived threshold is this many times a high quantile of recent step times (0: off).
    step_time_factor: float = field(default=5.0, metadata=bounds(0.0, 1e4))
    step_time_quantile: float = field(default=0.99, metadata=bounds(0.5, 1.0))
    #: the derived threshold's floor: a scheduler hiccup or a GC pause is not a hang.
    min_stall_s: float = field(default=10.0, metadata=bounds(0.1, 1e7))
    #: recent step times kept, all ranks together, and how many are needed before they are used.
    step_time_window: int = field(default=512, metadata=bounds(1, 1_000_000))
    min_step_samples: int = field(default=20, metadata=bounds(1, 1_000_000))
    #: a step reported this much later than its own duration after the rank's previous report
    #: (the rank was stopped in between: a restart), or one that is not the next step (a
    #: rewind, a first report), is a *first step*: its time is a process start and a checkpoint
    #: load, not a sample of the job's step time.  Counted, the eight 1-2 s first steps of each
    #: demo restart raised the p99 of 0.3-0.8 s steps to 1.1 s and the stall threshold to 3.3 s.
    first_step_gap_s: float = field(default=1.0, metadata=bounds(0.0, 1e7))
    #: a rank whose last heartbeat is older than this counts as dead, not hung.
    heartbeat_timeout_s: float = field(default=60.0, metadata=bounds(0.1, 1e7))
    #: two-phase hang detection: after this fraction of the threshold without progress a
    #: ``hang_suspect`` asks for the stack capture early, so its dumps are in when the threshold
    #: is reached (the capture's verdict waits for it, and a step before it makes the capture
    #: moot).  Not while the job has not stepped since its last restart (a first step is slow).
    #: 0 (the default): off, the capture starts at the threshold.  Only for jobs whose step time
    #: is steady: on the demo's shared 2-core host, 0.5 suspected a hang every 20-30 s, and those
    #: captures (py-spy stops each process it reads) slowed the job (mean step 0.43 s, not 0.33).
    precapture_fraction: float = field(default=0.0, metadata=bounds(0.0, 1.0))


class StepStallDetector:
    """Hang suspicion: every live rank stopped advancing its step for longer than the threshold
    (:meth:`threshold_s`: derived from the job's step time, see :class:`StallConfig`).

    A dead rank makes this a crash, handled by exit codes and logs, so no hang is reported
    while any tracked rank is dead.  ``since`` (the end of the job's last recovery) moves the
    start of a stall forward: a restarted job is not stalled for the time it was stopped.

    Examples
    --------
    >>> d = StepStallDetector(StallConfig(stall_s=60), job="j")
    >>> for r in range(4):
    ...     d.update(r, 100, ts=0.0)
    >>> d.update(0, 101, ts=10.0); d.update(1, 101, ts=10.0); d.update(2, 101, ts=10.0)
    >>> d.check(now=30.0) is None
    True
    >>> f = d.check(now=80.0, alive={0: True, 1: True, 2: True, 3: True})
    >>> f.kind, f.action.value, f.ranks, f.evidence["last_step"][3]
    ('hang', 'aggregate', (3,), 100)

    With the step time known, the threshold follows it (5 x p99 of 0.5 s steps, floored at 10 s):

    >>> d = StepStallDetector(StallConfig(stall_s=600), job="j")
    >>> for step in range(1, 30):
    ...     d.update(0, step, ts=step * 0.5, step_time_s=0.5)
    >>> d.threshold_s()
    10.0
    >>> d.check(now=14.0 + 10.5).evidence["threshold_s"]
    10.0
    """

    #: recent step times (seconds), all ranks together; created on the first one.  Not kept in
    #: the worker state (``STATE_SKIP``): written with every flush of every job it cost the
    #: worker a fifth of its CPU at 1,200 machines, and it refills within ``min_step_samples``
    #: rank-steps (``stall_s`` holds until then).
    _times: deque[float] | None = None
    STATE_SKIP = ("_times",)

    def __init__(self, config: StallConfig | None = None, job: str | None = None) -> None:
        self.config = config or StallConfig()
        self.job = job
        self._step: dict[int, int] = {}
        self._progress_ts: dict[int, float] = {}

    def update(self, rank: int, step: int, ts: float, step_time_s: float | None = None) -> None:
        """Record that ``rank`` reported ``step`` at ``ts`` (taking ``step_time_s``, as the rank
        measured it, or else the time since its previous step); a step other than the rank's
        last is progress.  That includes a step *lower* than before: a job restarted from a
        checkpoint recomputes the steps it lost, and taking that for no progress made every rewind
        of more than ``stall_s`` worth of steps (a NaN's last good checkpoint) look like a hang."""
        if isinstance(step, bool) or not isinstance(step, int) or _finite(ts) is None:
            return
        previous = self._step.get(rank)
        if previous is not None and step == previous:
            return
        duration = _finite(step_time_s)
        if previous is None or step != previous + 1:
            duration = None  # a first step (see ``first_step_gap_s``)
        elif duration is None:
            # The time since the rank's last step -- unless that spans a stop: no step time at
            # all is better than a restart's outage taken for a step.
            gap = ts - self._progress_ts[rank]
            duration = gap if 0 < gap < self.config.stall_s else None
        elif ts - self._progress_ts[rank] > duration + self.config.first_step_gap_s:
            duration = None  # the rank was stopped between the two: this one is a first step
        if duration is not None and duration > 0:
            if self._times is None or self._times.maxlen != self.config.step_time_window:
                self._times = deque(self._times or (), maxlen=self.config.step_time_window)
            self._times.append(duration)
        self._step[rank] = step
        self._progress_ts[rank] = ts

    def threshold_s(self) -> float:
        """How long no progress is a stall now: ``step_time_factor`` x the step-time quantile
        within [``min_stall_s``, ``stall_s``], or ``stall_s`` while too few step times are known."""
        cfg = self.config
        times = self._times
        if cfg.step_time_factor <= 0 or times is None or len(times) < cfg.min_step_samples:
            return cfg.stall_s
        ordered = sorted(times)
        q = ordered[min(len(ordered) - 1, int(cfg.step_time_quantile * len(ordered)))]
        return min(cfg.stall_s, max(cfg.min_stall_s, cfg.step_time_factor * q))

    def last_progress(self) -> float | None:
        """When any rank last progressed (event time, seconds); None before the first step."""
        return max(self._progress_ts.values()) if self._progress_ts else None

    def check(
        self,
        now: float,
        alive: Mapping[int, bool] | None = None,
        heartbeats: Mapping[int, float] | None = None,
        since: float | None = None,
    ) -> Finding | None:
        """A hang finding if no rank progressed for :meth:`threshold_s` while all are alive; a
        ``hang_suspect`` finding (the same evidence, ``confirm_at_ms`` saying when it becomes a
        hang) after ``precapture_fraction`` of it; else None.

        ``alive`` (rank -> process alive) wins over ``heartbeats`` (rank -> last heartbeat ts);
        with neither, every rank that ever reported is assumed alive.  ``since``: a stall
        starts no earlier (the end of the job's last recovery).
        """
        ranks = set(self._step) | set(alive or {}) | set(heartbeats or {})
        if not ranks or not self._progress_ts:
            return None
        if alive is not None:
            live = {r for r in ranks if alive.get(r, False)}
        elif heartbeats is not None:
            live = {r for r in ranks if now - heartbeats.get(r, -math.inf) <= self.config.heartbeat_timeout_s}
        else:
            live = ranks
        if live != ranks:
            return None
        last_progress = max(self._progress_ts.values())
        stepped_since_restart = since is None or since <= last_progress
        if since is not None and since > last_progress:
            last_progress = since
        stalled_for = now - last_progress
        threshold = self.threshold_s()
        kind = "hang"
        if stalled_for < threshold:
            early = self.config.precapture_fraction
            if not (early > 0 and stepped_since_restart and stalled_for >= early * threshold):
                return None
            kind = "hang_suspect"
        top = max(self._step.values())
        behind = sorted(r for r in ranks if self._step.get(r, -1) < top) or sorted(ranks)
        return Finding(
            kind=kind,
            category="job_hang",
            severity=Severity.ERROR,
            action=Action.AGGREGATE,
            job=self.job,
            ranks=tuple(behind),
            score=stalled_for,
            evidence={
                "stalled_for_s": stalled_for,
                "threshold_s": round(threshold, 3),
                "step_times_known": len(self._times or ()),
                "max_step": top,
                "last_step": {r: self._step.get(r) for r in sorted(ranks)},
                "ranks_behind": behind if behind != sorted(ranks) else [],
                # how long until the stall reaches the threshold (a suspect's capture waits).
                "confirm_in_s": round(max(0.0, threshold - stalled_for), 3),
            },
            ts=now,
        )


# --- stragglers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StragglerConfig:
    """Settings of :class:`StragglerDetector`."""

    #: step times older than this (relative to the check) are forgotten.
    window_s: float = field(default=300.0, metadata=bounds(1.0, 1e7))
    #: robust z-score (median/MAD across ranks) at or above which a rank is a straggler.
    z_threshold: float = field(default=3.5, metadata=bounds(0.1, 1e6))
    #: and it must be at least this much slower than the median rank (ignores tiny spreads).
    min_slowdown: float = field(default=1.1, metadata=bounds(1.0, 1e6))
    #: ranks with samples needed for a comparison; samples a rank needs to be judged.
    min_ranks: int = field(default=4, metadata=bounds(2, 10_000_000))
    min_samples: int = field(default=3, metadata=bounds(1, 100_000))
    #: MAD floor as a fraction of the median, so identical ranks do not make z infinite.
    mad_floor_frac: float = field(default=0.01, metadata=bounds(0.0, 1.0))
    #: a rank's first steps after each (re)start are not judged: they are slow for reasons that
    #: are not the rank's (lazy initialisation, a checkpoint load, cold caches).  A demo run's
    #: straggler vote on its first steps evicted two healthy machines 18 s in.
    warmup_steps: int = field(default=5, metadata=bounds(0, 1_000_000))


class StragglerDetector:
    """Per-rank step-time stragglers of one job by robust z-score over a recent window.

    Examples
    --------
    >>> d = StragglerDetector(job="j")
    >>> for t in range(5):
    ...     for r in range(8):
    ...         d.observe(r, 1.0 + 0.01 * r + (0.6 if r == 5 else 0.0), ts=float(t))
    >>> f = d.check(now=5.0)
    >>> f.kind, f.ranks, f.action.value, f.score > 3.5
    ('straggler', (5,), 'aggregate', True)
    """

    def __init__(self, config: StragglerConfig | None = None, job: str | None = None) -> None:
        self.config = config or StragglerConfig()
        self.job = job
        self._times: dict[int, deque[tuple[float, float]]] = {}

    #: rank -> (its last step, steps in a row since its last (re)start); class-level default:
    #: detectors restored from state written before it existed start without it.
    _run: dict[int, tuple[int, int]] | None = None

    def observe(self, rank: int, step_time_s: Any, ts: float, step: int | None = None) -> None:
        """Record one step time of ``rank`` (non-finite or non-positive values are ignored).
        With ``step``, the first ``warmup_steps`` after each (re)start of the rank -- a step that
        does not follow its last one -- are left out."""
        if step is not None and self.config.warmup_steps > 0:
            run = self._run if self._run is not None else {}
            self._run = run
            last, count = run.get(rank, (None, 0))
            count = count + 1 if last is not None and step == last + 1 else 1
            run[rank] = (step, count)
            if count <= self.config.warmup_steps:
                return
        v = _finite(step_time_s)
        if v is None or v <= 0 or _finite(ts) is None:
            return
        self._times.setdefault(rank, deque(maxlen=10_000)).append((ts, v))

    def scores(self, now: float) -> dict[int, tuple[float, float]]:
        """rank -> (median step time in the window, robust z-score); empty if too few ranks."""
        lo = now - self.config.window_s
        medians = {}
        for rank, q in self._times.items():
            while q and q[0][0] < lo:
                q.popleft()
            vals = [v for t, v in q if t <= now]
            if len(vals) >= self.config.min_samples:
                medians[rank] = statistics.median(vals)
        if len(medians) < self.config.min_ranks:
            return {}
        center = statistics.median(medians.values())
        mad = statistics.median(abs(m - center) for m in medians.values())
        # 1.4826 makes the MAD a consistent estimator of the standard deviation.
        scale = max(1.4826 * mad, self.config.mad_floor_frac * center, 1e-12)
        return {r: (m, (m - center) / scale) for r, m in medians.items()}

    def check(self, now: float) -> Finding | None:
        """A fail-slow finding naming the straggler ranks, or None."""
        sc = self.scores(now)
        if not sc:
            return None
        center = statistics.median(m for m, _ in sc.values())
        slow = sorted(
            r
            for r, (m, z) in sc.items()
            if z >= self.config.z_threshold and m >= self.config.min_slowdown * center
        )
        if not slow:
            return None
        return Finding(
            kind="straggler",
            category="fail_slow",
            severity=Severity.WARNING,
            action=Action.AGGREGATE,
            job=self.job,
            ranks=tuple(slow),
            score=max(sc[r][1] for r in slow),
            evidence={
                "median_step_s": center,
                "step_s": {r: sc[r][0] for r in slow},
                "z": {r: sc[r][1] for r in slow},
                "ranks_compared": len(sc),
            },
            ts=now,
        )


# --- MFU decline -------------------------------------------------------------------------------


@dataclass(frozen=True)
class MfuConfig:
    """Settings of :class:`MfuDeclineDetector`."""

    #: accepted MFU values in the rolling baseline (median).
    baseline_window: int = field(default=100, metadata=bounds(1, 1_000_000))
    warmup: int = field(default=10, metadata=bounds(1, 1_000_000))
    #: MFU below (1 - decline_frac) x baseline is low.
    decline_frac: float = field(default=0.1, metadata=bounds(0.0, 1.0))
    #: consecutive low values before reporting (one finding per episode).
    sustain: int = field(default=3, metadata=bounds(1, 1_000_000))


class MfuDeclineDetector:
    """Fail-slow suspicion: the job's MFU stays below its own rolling baseline.

    Examples
    --------
    >>> d = MfuDeclineDetector(MfuConfig(warmup=5, sustain=2), job="j")
    >>> [d.observe(float(t), 0.42) for t in range(5)]
    [None, None, None, None, None]
    >>> d.observe(5.0, 0.30) is None, d.observe(6.0, 0.31).kind
    (True, 'mfu_decline')
    """

    def __init__(self, config: MfuConfig | None = None, job: str | None = None) -> None:
        self.config = config or MfuConfig()
        self.job = job
        self._baseline: deque[float] = deque(maxlen=self.config.baseline_window)
        self._low = 0

    def observe(self, ts: float, mfu: Any) -> Finding | None:
        """Feed one MFU sample (a fraction or a percentage, consistently); maybe a finding."""
        v = _finite(mfu)
        if v is None or v <= 0:
            return None
        if len(self._baseline) >= self.config.warmup:
            base = statistics.median(self._baseline)
            if v < (1.0 - self.config.decline_frac) * base:
                self._low += 1  # low values stay out of the baseline, or it would follow them down
                if self._low != self.config.sustain:
                    return None
                return Finding(
                    kind="mfu_decline",
                    category="mfu_decline",
                    severity=Severity.WARNING,
                    action=Action.AGGREGATE,
                    job=self.job,
                    score=1.0 - v / base,
                    evidence={"mfu": v, "baseline": base, "low_samples": self._low},
                    ts=ts,
                )
        self._low = 0
        self._baseline.append(v)
        return None
