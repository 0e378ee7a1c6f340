"""Postmortem queries: ETTR and incident timelines, computed from ClickHouse alone.

**ETTR** (ByteRobust: productive training time / wall-clock time of the job).  Productive time
is the step time of every step that *survived*: when a job restarts from a checkpoint, the steps
after that checkpoint are recomputed, and only their last occurrence counts (``argMax`` by
``ts_ms``); the lost work is unproductive, and so is a surviving step whose loss is NaN or
infinite (its update made the weights worse, not better: a job that trains on through a NaN
is not productive however fast it steps).  Wall-clock runs from the start of the first step to
the end of the last.  The 1-hour sliding ETTR applies the same rule to steps that ended within
each hour-long window.  One rank (0 by default) stands for the job: every rank steps together.

**Incidents**: a decision is an incident; its timeline joins the detection that triggered it
(detected), the decision (decided), and the action service's events (recovered = the last
``succeeded`` event, or ``failed``), with durations relative to the source event time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from infra.clickhouse.store import ClickHouseStore

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


def _steps(store: ClickHouseStore, job: str, rank: int) -> list[tuple[int, int, float]]:
    """(step, end ts_ms, productive seconds) of every occurrence of every step of ``rank``, by
    time; a step with a non-finite loss is 0 productive seconds."""
    rows = store.query(
        "SELECT step, ts_ms, ifNull(step_time_s, 0), ifNull(loss, 0) FROM training_steps FINAL "
        "WHERE job = %(j)s AND rank = %(r)s ORDER BY ts_ms",
        {"j": job, "r": rank},
    )
    return [(int(s), int(t), float(d) if math.isfinite(float(x)) else 0.0) for s, t, d, x in rows]


def ettr(store: ClickHouseStore, job: str, rank: int = 0) -> Ettr:
    occ = _steps(store, job, rank)
    if not occ:
        return Ettr(job, 0.0, 0.0, 0, 0)
    last: dict[int, tuple[int, float]] = {}
    for step, ts, dur in occ:
        last[step] = (ts, dur)  # ordered by time: the final occurrence wins
    productive = sum(d for _, d in last.values())
    start = occ[0][1] - occ[0][2] * 1000
    wall = (occ[-1][1] - start) / 1000
    return Ettr(job, productive, wall, len(last), len(occ) - len(last))


def sliding_ettr(
    store: ClickHouseStore, job: str, window_ms: int = HOUR_MS, rank: int = 0
) -> list[tuple[int, float]]:
    """(window end ts_ms, ETTR over the preceding window) at every step end."""
    occ = _steps(store, job, rank)
    if not occ:
        return []
    final_ts = {}
    for step, ts, _ in occ:
        final_ts[step] = ts
    survivors = sorted((ts, dur) for step, ts, dur in occ if final_ts[step] == ts)
    start = occ[0][1] - occ[0][2] * 1000
    out = []
    for end_ts, _ in survivors:
        lo = max(start, end_ts - window_ms)
        productive = sum(min(d * 1000, ts - lo) for ts, d in survivors if lo < ts <= end_ts)
        span = end_ts - lo
        out.append((end_ts, productive / span if span > 0 else 0.0))
    return out


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
    recovered_ts_ms: int | None = None
    outcome: str = "pending"
    steps: list[dict[str, Any]] = field(default_factory=list)

    def seconds(self, ts: int | None) -> float | None:
        return None if ts is None else round((ts - self.source_ts_ms) / 1000, 3)

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
            "outcome": self.outcome,
            "steps": self.steps,
        }


def incidents(
    store: ClickHouseStore, job: str | None = None, decision_id: str | None = None
) -> list[Incident]:
    where, params = ["1"], {}
    if job:
        where.append("d.job = %(job)s")
        params["job"] = job
    if decision_id:
        where.append("d.decision_id = %(dec)s")
        params["dec"] = decision_id
    decs = store.query_dicts(
        "SELECT decision_id, job, action, machines, detection_ids, evidence, ts_ms "
        f"FROM decisions AS d FINAL WHERE {' AND '.join(where)} ORDER BY ts_ms",
        params,
    )
    out = []
    for d in decs:
        ev = json.loads(d["evidence"] or "{}").get("detection", {})
        ids = [str(i) for i in d["detection_ids"]]
        det_rows = (
            store.query(
                "SELECT min(ts_ms), min(source_ts_ms) FROM detections FINAL WHERE has(%(ids)s, detection_id)",
                {"ids": ids},
            )
            if ids  # an empty array literal has no element type on 18.16
            else []
        )
        detected = int(det_rows[0][0]) if det_rows and det_rows[0][0] else int(d["ts_ms"])
        source = int(ev.get("source_ts_ms") or (det_rows[0][1] if det_rows else 0) or detected)
        inc = Incident(
            d["decision_id"],
            d["job"],
            d["action"],
            str(ev.get("category", "")),
            str(ev.get("kind", "")),
            list(d["machines"]),
            source,
            detected,
            int(d["ts_ms"]),
        )
        acts = store.query_dicts(
            "SELECT step, phase, ts_ms, duration_ms, detail FROM action_events FINAL "
            "WHERE decision_id = %(d)s ORDER BY ts_ms, event_id",
            {"d": d["decision_id"]},
        )
        inc.steps = [
            {
                "step": a["step"],
                "phase": a["phase"],
                "at_s": inc.seconds(int(a["ts_ms"])),
                "duration_ms": a["duration_ms"],
                "detail": a["detail"],
            }
            for a in acts
        ]
        done = [a for a in acts if a["step"] == "recovery" and a["phase"] in ("succeeded", "failed", "held")]
        if done:
            inc.outcome = done[-1]["phase"]
            inc.recovered_ts_ms = int(done[-1]["ts_ms"]) if done[-1]["phase"] == "succeeded" else None
        out.append(inc)
    return out
