"""Slow data: a rank's data loader starving compute, against the rank's own history.

Each step the training reporter may say how long the loop waited for its batch
(``TrainingStep.data_wait_s``); with the step time that is the fraction of the step spent
waiting for data.  A healthy loader keeps it near a steady level (prefetching hides most
loading); a loader falling behind -- slow storage, an overloaded host CPU, too few workers for a
new augmentation -- pushes it up while every process stays alive and the job keeps stepping, only
slower.  This detector flags that: per rank, after a warm-up, the fraction against a robust
baseline of the rank's recent accepted fractions (median + MAD), for at least ``min_duration_s``.

It is not the hung loader.  A loader that stops yields no batch, so the rank stops stepping and
reports nothing for this detector to see: that is the stall detector's ``job_hang`` (stack
capture, and the over-eviction analysis finds the rank's DataLoader).  A slow loader's steps keep
coming, just with long waits.

The recommended action is ``ignore`` (recorded, never a decision): the machine is not sick, so
evicting it, restarting the job or stopping it for machine diagnostics would cost training time
and fix nothing -- the remedy is the loader's configuration or its storage, an operator's call.
The detection (rank, node, fraction, baseline) is what tells them; a ``slow_data_cleared``
finding marks the episode's end.

>>> d = SlowDataDetector(SlowDataConfig(warmup_steps=2, min_samples=5, min_duration_s=3, min_steps=3,
...                                     clear_steps=3), job="j")
>>> def step(t, wait):  # 1 s steps, ``wait`` of it waiting for data
...     return d.observe(0, step=t, ts=float(t), step_time_s=1.0, data_wait_s=wait)
>>> [step(t, 0.05) for t in range(10)] == [None] * 10
True
>>> [f and f.kind for f in (step(t, 0.7) for t in range(10, 15))]
[None, None, None, 'slow_data', None]
>>> f = d.last_finding
>>> f.category, f.action.value, f.ranks, round(f.evidence["fraction"], 2), d.starving()
('slow_data', 'ignore', (0,), 0.7, [0])
>>> [f and f.kind for f in (step(t, 0.05) for t in range(15, 20))]
[None, None, 'slow_data_cleared', None, None]
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from trainguard.detectors.findings import Finding
from trainguard.schemas.enums import Action, Severity
from trainguard.schemas.typecheck import bounds

KIND = "slow_data"
CLEARED = "slow_data_cleared"
#: makes the MAD a consistent estimator of the standard deviation.
MAD_SCALE = 1.4826


@dataclass(frozen=True)
class SlowDataConfig:
    """Settings of :class:`SlowDataDetector`."""

    #: a rank's first steps after each (re)start are neither judged nor learned: its loader's
    #: workers are starting and filling their prefetch queues, so those waits say nothing.
    warmup_steps: int = field(default=10, metadata=bounds(0, 1_000_000))
    #: accepted fractions a rank needs before it is judged, and how many recent ones form its baseline.
    min_samples: int = field(default=20, metadata=bounds(1, 1_000_000))
    window: int = field(default=200, metadata=bounds(1, 1_000_000))
    #: starving: the fraction at or above median + z_threshold x the baseline's scaled MAD ...
    z_threshold: float = field(default=4.0, metadata=bounds(0.0, 1e6))
    #: ... and at least this far above the median (a very steady loader has a MAD near 0) ...
    min_rise: float = field(default=0.1, metadata=bounds(0.0, 1.0))
    #: ... and at least this fraction of the step: below it, data loading costs too little to act on.
    min_fraction: float = field(default=0.2, metadata=bounds(0.0, 1.0))
    #: starving this long (event time, from its first starving step) and this many steps before a
    #: finding: one slow batch (a cold file, a GC pause in a worker) is not a slow loader.
    min_duration_s: float = field(default=60.0, metadata=bounds(0.0, 1e7))
    min_steps: int = field(default=5, metadata=bounds(1, 1_000_000))
    #: healthy steps in a row that end an episode (and report its end if it was reported).
    clear_steps: int = field(default=10, metadata=bounds(1, 1_000_000))


@dataclass
class _Rank:
    """One rank's baseline and current episode."""

    baseline: deque[float]
    last_step: int | None = None
    run: int = 0  # steps in a row since the rank's last (re)start
    since: float | None = None  # first starving step of the episode (event time)
    starving_steps: int = 0
    healthy_streak: int = 0
    reported: bool = False
    peak: float = 0.0


def wait_fraction(step_time_s: Any, data_wait_s: Any) -> float | None:
    """The fraction of a step spent waiting for data, in [0, 1]; None when unknown.

    ``step_time_s`` is the whole step, wait included (the reporter's default: the time between
    two ``step()`` calls); a wait longer than it (a step time measured without the fetch) counts
    as the whole step.

    >>> wait_fraction(0.5, 0.1), wait_fraction(0.5, 2.0), wait_fraction(None, 0.1), wait_fraction(0, 0)
    (0.2, 1.0, None, None)
    """
    vals = []
    for v in (step_time_s, data_wait_s):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            return None
        vals.append(float(v))
    step, wait = vals
    if step <= 0:
        return None
    return min(1.0, wait / step)


class SlowDataDetector:
    """Per-rank slow-data episodes of one job (see the module docstring)."""

    def __init__(self, config: SlowDataConfig | None = None, job: str | None = None) -> None:
        self.config = config or SlowDataConfig()
        self.job = job
        self._ranks: dict[int, _Rank] = {}
        #: the last finding returned (for callers that only poll).
        self.last_finding: Finding | None = None

    def threshold(self, rank: int) -> float | None:
        """The fraction at or above which ``rank`` is starving now; None until it has a baseline."""
        r = self._ranks.get(rank)
        cfg = self.config
        if r is None or len(r.baseline) < cfg.min_samples:
            return None
        median = statistics.median(r.baseline)
        mad = statistics.median(abs(v - median) for v in r.baseline)
        return max(cfg.min_fraction, median + max(cfg.z_threshold * MAD_SCALE * mad, cfg.min_rise))

    def starving(self) -> list[int]:
        """The ranks in a reported slow-data episode now."""
        return sorted(rank for rank, r in self._ranks.items() if r.reported)

    def observe(
        self, rank: int, step: int, ts: float, step_time_s: Any, data_wait_s: Any, node: str | None = None
    ) -> Finding | None:
        """Feed one step of ``rank``; a ``slow_data`` finding when an episode has lasted long
        enough, a ``slow_data_cleared`` one when a reported episode ends, else None.  Steps
        without a usable wait or step time are ignored (they neither judge nor teach)."""
        cfg = self.config
        r = self._ranks.get(rank)
        if r is None or r.baseline.maxlen != cfg.window:
            r = self._ranks[rank] = _Rank(deque(r.baseline if r else (), maxlen=cfg.window))
        # A step that does not follow the rank's last one is a (re)start: a new process with a
        # cold loader, so warm up again; an episode of the previous process ended with it.
        if r.last_step is None or step != r.last_step + 1:
            r.run, r.since, r.starving_steps, r.healthy_streak, r.reported = 0, None, 0, 0, False
        r.last_step = step
        r.run += 1
        frac = wait_fraction(step_time_s, data_wait_s)
        if frac is None or not math.isfinite(ts) or r.run <= cfg.warmup_steps:
            return None
        limit = self.threshold(rank)
        if limit is None or frac < limit:
            # Healthy: learned (starving steps never are, or a long episode would become the norm).
            r.baseline.append(frac)
            r.healthy_streak += 1
            if r.since is not None and r.healthy_streak >= cfg.clear_steps:
                ended = self._finding(CLEARED, rank, ts, frac, limit, r, node) if r.reported else None
                r.since, r.starving_steps, r.reported = None, 0, False
                return ended
            return None
        r.healthy_streak = 0
        if r.since is None:
            r.since, r.starving_steps, r.peak = ts, 0, 0.0
        r.starving_steps += 1
        r.peak = max(r.peak, frac)
        if r.reported or r.starving_steps < cfg.min_steps or ts - r.since < cfg.min_duration_s:
            return None
        r.reported = True
        return self._finding(KIND, rank, ts, frac, limit, r, node)

    def _finding(
        self, kind: str, rank: int, ts: float, frac: float, limit: float | None, r: _Rank, node: str | None
    ) -> Finding:
        cleared = kind == CLEARED
        median = statistics.median(r.baseline)
        self.last_finding = Finding(
            kind=kind,
            category=KIND,
            severity=Severity.INFO if cleared else Severity.WARNING,
            action=Action.IGNORE,
            job=self.job,
            ranks=(rank,),
            node=node or None,
            score=frac if cleared else r.peak,
            evidence={
                "fraction": frac,
                "baseline_median": median,
                "threshold": limit,
                "starving_since": r.since,
                "starving_steps": r.starving_steps,
                "peak_fraction": r.peak,
            },
            ts=ts,
        )
        return self.last_finding
