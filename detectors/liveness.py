"""Machines of a job that fell silent while the job stopped: a frozen or lost node, found from its
exporter's liveness (:class:`~trainguard.schemas.workload.RankLiveness`) without waiting for a stack capture
to time out on it.

Each node's exporter says every few seconds which of the job's ranks live there (an empty list
too: the node is up, the job is not running on it).  A node *runs* the job while its last word
listed ranks, heard since the job's last restart (a machine evicted before it, whose exporter
went away with it, ran the job no more).  Such a node is *silent* once nothing came from it -- no
liveness, no step of its ranks -- for ``silence_intervals`` of its own liveness interval (at least
``min_silence_s``).
A silent node is a finding (evict it: ``machine_silent``) only when

* the job has stopped progressing for as long (a node whose exporter died while its ranks keep
  training is an exporter to restart, not a machine to evict: the ranks' steps come through the
  exporter, so the job's progress is judged job-wide), and
* another node of the job is still heard from (every node silent at once is the input lagging
  or the whole job gone, not one machine's fault).

One finding per silence: a node heard from again may be reported again later.  Pure: the caller
supplies the clock (event time, seconds).

>>> d = SilentMachineDetector(job="j")
>>> for t in (0.0, 2.0, 4.0):
...     d.liveness("n1", [0, 1], t, 2.0); d.liveness("n2", [2, 3], t, 2.0)
>>> d.liveness("n2", [2, 3], 12.0, 2.0)  # n1 froze after t=4
>>> f = d.check(now=12.5, last_progress=4.0)
>>> f.kind, f.action.value, f.ranks, f.evidence["evict"]["machine_names"]
('machine_silent', 'evict', (0, 1), ['n1'])
>>> d.check(now=13.0, last_progress=4.0) is None  # reported once
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from trainguard.detectors.findings import Finding
from trainguard.schemas.enums import Action, Severity
from trainguard.schemas.typecheck import bounds


@dataclass(frozen=True)
class LivenessConfig:
    """Settings of :class:`SilentMachineDetector`."""

    enabled: bool = True
    #: a node is silent after this many of its liveness intervals without a word ...
    silence_intervals: float = field(default=3.0, metadata=bounds(1.0, 1e4))
    #: ... and never before this long (a GC pause, a slow /proc read on a busy host).
    min_silence_s: float = field(default=5.0, metadata=bounds(0.1, 1e7))


class SilentMachineDetector:
    """See the module docstring."""

    def __init__(self, config: LivenessConfig | None = None, job: str | None = None) -> None:
        self.config = config or LivenessConfig()
        self.job = job
        #: node -> when it was last heard from (liveness or a step), its interval, its ranks.
        self.heard: dict[str, float] = {}
        self.interval: dict[str, float] = {}
        self.ranks: dict[str, tuple[int, ...]] = {}
        #: node -> when its liveness last listed ranks (it ran the job then).
        self.ranked_at: dict[str, float] = {}
        #: nodes reported silent and not heard from since.
        self.reported: set[str] = set()

    def liveness(self, node: str, ranks: Sequence[int], ts: float, interval_s: float) -> None:
        if ts >= self.heard.get(node, float("-inf")):
            self.ranks[node] = tuple(sorted(ranks))
        if ranks:
            self.ranked_at[node] = max(ts, self.ranked_at.get(node, ts))
        self._hear(node, ts)
        self.interval[node] = interval_s

    def step(self, node: str, ts: float) -> None:
        """A step of one of the node's ranks: the node speaks (only nodes that sent liveness count)."""
        if node in self.heard:
            self._hear(node, ts)

    def _hear(self, node: str, ts: float) -> None:
        if ts > self.heard.get(node, float("-inf")):
            self.heard[node] = ts
            self.reported.discard(node)

    def bound_s(self, node: str) -> float:
        return max(self.config.min_silence_s, self.config.silence_intervals * self.interval.get(node, 0.0))

    def running(self, since: float | None = None) -> list[str]:
        """The nodes running the job: their last word listed ranks, at or after ``since`` (the
        job's last restart)."""
        return sorted(
            n
            for n in self.heard
            if self.ranks.get(n) and (since is None or self.ranked_at.get(n, 0.0) >= since)
        )

    def clock(self, now: float) -> float:
        """The time silences are judged at: the newest word heard from any node of the job, not
        the caller's clock -- the liveness topic can lag the steps a worker judges progress by
        (a busy worker took a node heard 2 s before for 6 s silent in a demo run), and a node
        is silent only when the others spoke later than it did."""
        return min(now, max(self.heard.values(), default=now))

    def silent(self, now: float, since: float | None = None) -> list[str]:
        """The nodes running the job (since ``since``) that are silent now (reported or not)."""
        at = self.clock(now)
        return [n for n in self.running(since) if at - self.heard[n] > self.bound_s(n)]

    def check(self, now: float, last_progress: float | None, since: float | None = None) -> Finding | None:
        """A ``machine_silent`` finding for the nodes newly silent while the job is stopped (see the
        module docstring); ``last_progress``: when the job last progressed (None: never);
        ``since``: the end of the job's last restart (nodes not running the job since are not judged)."""
        if not self.config.enabled:
            return None
        silent = self.silent(now, since)
        new = [n for n in silent if n not in self.reported]
        if not new:
            return None
        at = self.clock(now)
        fresh = [n for n, t in self.heard.items() if n not in silent and at - t <= self.bound_s(n)]
        stopped_for = at - last_progress if last_progress is not None else float("inf")
        if not fresh or stopped_for < min(self.bound_s(n) for n in new):
            return None
        self.reported.update(new)
        ranks = sorted(r for n in new for r in self.ranks[n])
        return Finding(
            kind="machine_silent",
            category="machine_unreachable",
            severity=Severity.CRITICAL,
            action=Action.EVICT,
            job=self.job,
            ranks=tuple(ranks),
            node=new[0] if len(new) == 1 else None,
            score=max(at - self.heard[n] for n in new),
            evidence={
                "silent": {
                    n: {
                        "last_heard_s": round(self.heard[n], 3),
                        "silent_for_s": round(at - self.heard[n], 3),
                        "bound_s": round(self.bound_s(n), 3),
                        "ranks": list(self.ranks[n]),
                    }
                    for n in new
                },
                "job_stopped_for_s": None if last_progress is None else round(stopped_for, 3),
                "machines_heard": len(fresh),
                "evict": {"kind": "machine", "ranks": ranks, "machine_names": new},
            },
            ts=now,
        )

    def forget(self, node: str) -> None:
        """Stop tracking ``node`` (it left the job's machines)."""
        for d in (self.heard, self.interval, self.ranks, self.ranked_at):
            d.pop(node, None)
        self.reported.discard(node)
