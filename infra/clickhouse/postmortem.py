"""Postmortem queries: ETTR and incident timelines, computed from ClickHouse alone.

**ETTR** (ByteRobust: productive training time / wall-clock time of the job).  Productive time
is the step time of every step that *survived*: when a job restarts from a checkpoint, the steps
after that checkpoint are recomputed, and only their last occurrence counts (``argMax`` by
``ts_ms``); the lost work is unproductive, and so is a surviving step whose loss is NaN or
infinite (its update made the weights worse, not better: a job that trains on through a NaN
is not productive however fast it steps).  Wall-clock runs from the start of the first step to
the end of the last.  The 1-hour sliding ETTR applies the same rule to steps that ended within
each hour-long window.  One rank (0 by default) stands for the job: every rank steps together.

The SQL lives in the named queries (:mod:`trainguard.infra.clickhouse.named`: ``ettr``, ``training_curve``,
``incidents``, ``incident_steps``), which ``trainguard sql`` runs too.

**Incidents**: a decision is an incident; its timeline joins the detection that triggered it
(detected), the decision (decided), the action service's events (how the recovery ended) and the
job's training steps, with durations relative to the source event time (the fault's first sign).
*Recovered* is the job's first training step after a successful recovery: after its last restart
(the restarted processes still load, and under Slurm they take ~20 s more to step), or after its
end when it restarted nothing -- training again, which is what the job lost time to.  The
procedure's own duration, from the decision to the recovery's end, is *procedure* (``procedure_s``):
a recovery that took 0.65 s may still leave the job without a step for 5 s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trainguard.infra.clickhouse import named
from trainguard.infra.clickhouse.store import ClickHouseStore

HOUR_MS = 3_600_000


@dataclass(frozen=True)
class Ettr:
    job: str
    productive_s: float
    wall_s: float
    steps: int
    recomputed_steps: int

    @property
    def ettr(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0


def ettr(store: ClickHouseStore, job: str, rank: int = 0) -> Ettr:
    """The named query ``ettr``."""
    (row,) = named.get("ettr").run(store, job=job, rank=rank)
    return Ettr(
        job,
        float(row["productive_s"] or 0.0),
        float(row["wall_s"] or 0.0),
        int(row["steps"]),
        int(row["recomputed_steps"]),
    )


def training_curve(
    store: ClickHouseStore, job: str, rank: int = 0, since_ms: int = 0
) -> list[dict[str, Any]]:
    """The named query ``training_curve``: every step occurrence, with ``survived``."""
    return named.get("training_curve").run(store, job=job, rank=rank, since_ms=since_ms)


def sliding_ettr(
    store: ClickHouseStore, job: str, window_ms: int = HOUR_MS, rank: int = 0
) -> list[tuple[int, float]]:
    """(window end ts_ms, ETTR over the preceding window) at every surviving step's end."""
    return sliding_ettr_of(training_curve(store, job, rank), window_ms)


def sliding_ettr_of(curve: list[dict[str, Any]], window_ms: int = HOUR_MS) -> list[tuple[int, float]]:
    """:func:`sliding_ettr` over rows of ``training_curve`` already read."""
    if not curve:
        return []
    start = min(int(r["ts_ms"]) - productive_s(r) * 1000 for r in curve)
    survivors = [(int(r["ts_ms"]), productive_s(r)) for r in curve if r["survived"]]
    out = []
    lo_i = 0
    acc = 0.0  # productive ms of survivors[lo_i:hi] (a window slides: O(n), not O(n^2))
    for hi, (end_ts, dur) in enumerate(survivors):
        acc += dur * 1000
        lo = max(start, end_ts - window_ms)
        while lo_i <= hi and survivors[lo_i][0] <= lo:
            acc -= survivors[lo_i][1] * 1000
            lo_i += 1
        # a step that began before the window counts only its part inside it (only the first
        # few can have: steps run one after another)
        clip, i = 0.0, lo_i
        while i <= hi and survivors[i][1] * 1000 > survivors[i][0] - lo:
            clip += survivors[i][1] * 1000 - (survivors[i][0] - lo)
            i += 1
        span = end_ts - lo
        out.append((end_ts, (acc - clip) / span if span > 0 else 0.0))
    return out


def productive_s(row: dict[str, Any]) -> float:
    """A ``training_curve`` row's productive seconds: its step time, 0 with a non-finite loss."""
    loss, took = row["loss"], row["step_time_s"]
    if took is None or (loss is not None and not math.isfinite(float(loss))):
        return 0.0
    return float(took)


@dataclass
class Incident:
    decision_id: str
    job: str
    action: str
    category: str
    kind: str
    machines: list[str]
    source_ts_ms: int
    detected_ts_ms: int
    decided_ts_ms: int
    #: the job's first training step after the recovery (None: not training again yet).
    recovered_ts_ms: int | None = None
    outcome: str = "pending"
    #: when the recovery procedure ended, whatever its outcome (None: it has not).
    ended_ts_ms: int | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)

    def seconds(self, ts: int | None) -> float | None:
        return None if ts is None else round((ts - self.source_ts_ms) / 1000, 3)

    @property
    def procedure_s(self) -> float | None:
        """The recovery procedure alone: the decision to the recovery's end."""
        return None if self.ended_ts_ms is None else round((self.ended_ts_ms - self.decided_ts_ms) / 1000, 3)

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision_id": self.decision_id,
            "job": self.job,
            "action": self.action,
            "category": self.category,
            "kind": self.kind,
            "machines": self.machines,
            "source_ts_ms": self.source_ts_ms,
            "detected_s": self.seconds(self.detected_ts_ms),
            # Localised: the decision named the culprit machines (a job-wide restart names none).
            "localised_s": self.seconds(self.decided_ts_ms) if self.machines else None,
            "decided_s": self.seconds(self.decided_ts_ms),
            "recovered_s": self.seconds(self.recovered_ts_ms),
            "procedure_s": self.procedure_s,
            "outcome": self.outcome,
            "steps": self.steps,
        }


def incidents(
    store: ClickHouseStore, job: str | None = None, decision_id: str | None = None, since_ms: int = 0
) -> list[Incident]:
    """The named query ``incidents``, each with its recovery's steps (``incident_steps``)."""
    rows = named.get("incidents").run(store, job=job or "", decision=decision_id or "", since_ms=since_ms)
    steps_q = named.get("incident_steps")
    out = []
    for r in rows:
        inc = Incident(
            r["decision_id"],
            r["job"],
            r["action"],
            r["category"],
            r["kind"],
            list(r["machines"]),
            int(r["source_ts_ms"]),
            int(r["detected_ts_ms"]),
            int(r["decided_ts_ms"]),
            int(r["recovered_ts_ms"]) or None,
            r["outcome"],
            int(r["ended_ts_ms"]) or None,
        )
        inc.steps = [
            {
                "step": a["step"],
                "phase": a["phase"],
                "at_s": inc.seconds(int(a["ts_ms"])),
                "duration_ms": a["duration_ms"],
                "detail": a["detail"],
            }
            for a in steps_q.run(store, decision=inc.decision_id)
        ]
        out.append(inc)
    return out
