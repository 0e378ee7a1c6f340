"""What a postmortem report shows, read from ClickHouse through the named queries.

Everything here comes from :mod:`trainguard.infra.clickhouse.named` (the same SQL ``trainguard sql run``
and ``trainguard postmortem`` use), so the report and a hand-run query never disagree.  The pure
helpers (:func:`cumulative_ettr`, :func:`downsample`, :func:`phases`) are tested directly.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from trainguard.infra.clickhouse import named
from trainguard.infra.clickhouse.postmortem import HOUR_MS, productive_s, sliding_ettr_of
from trainguard.infra.clickhouse.store import ClickHouseStore

#: decisions that start no recovery: listed with the decisions, not drawn as incidents.
NOT_ACTING = ("aggregate", "none", "ignore")

#: a plot of a months-long job keeps at most this many points (SVG: a browser draws 5,000 at ease).
MAX_POINTS = 5_000


@dataclass
class JobData:
    """One job's training curve and ETTR (the report's job, or its baseline)."""

    job: str
    ettr: dict[str, Any]
    curve: list[dict[str, Any]]  # training_curve rows, downsampled
    cumulative: list[tuple[int, float]]  # (ts_ms, ETTR from the start to then)
    sliding: list[tuple[int, float]]  # (ts_ms, ETTR over the hour before)
    points: int  # step occurrences before downsampling


@dataclass
class ReportData:
    job: JobData
    baseline: JobData | None
    since_ms: int
    generated_ms: int
    incidents: list[dict[str, Any]]  # acting incidents, each with "steps" (incident_steps rows)
    mttr: list[dict[str, Any]]
    evictions: list[dict[str, Any]]
    standbys: list[dict[str, Any]]
    decisions: list[dict[str, Any]]  # every decision, "evidence" parsed
    detection_latency: list[dict[str, Any]] = field(default_factory=list)
    #: the shadow loaders' takeovers and give-ups (``loader_takeovers`` rows).
    loaders: list[dict[str, Any]] = field(default_factory=list)
    #: the way back of the machines evicted (``node_transitions`` rows of those machines).
    node_transitions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.job.curve or self.decisions)


def cumulative_ettr(curve: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step end, productive time of the surviving steps so far / time since the first step began).

    >>> rows = [dict(ts_ms=1000, step=0, loss=1.0, step_time_s=1.0, survived=1),
    ...         dict(ts_ms=4000, step=1, loss=1.0, step_time_s=1.0, survived=1)]
    >>> cumulative_ettr(rows)
    [(1000, 1.0), (4000, 0.5)]
    """
    if not curve:
        return []
    start = min(int(r["ts_ms"]) - productive_s(r) * 1000 for r in curve)
    out, acc = [], 0.0
    for r in curve:
        if not r["survived"]:
            continue
        acc += productive_s(r) * 1000
        span = int(r["ts_ms"]) - start
        out.append((int(r["ts_ms"]), acc / span if span > 0 else 0.0))
    return out


def downsample(rows: list[Any], max_points: int = MAX_POINTS) -> list[Any]:
    """Every k-th row (the last one always kept), so that at most about ``max_points`` remain.

    >>> downsample(list(range(10)), 4)
    [0, 3, 6, 9]
    """
    if len(rows) <= max_points:
        return list(rows)
    k = -(-len(rows) // max_points)
    out = rows[::k]
    if out[-1] is not rows[-1]:
        out.append(rows[-1])
    return out


def phases(inc: dict[str, Any], end_ms: int) -> list[tuple[str, int, int]]:
    """An incident's phases as (name, from ms, to ms): detect (first sign -> detection), localise
    (-> the decision named machines), decide (-> the decision), recover (the procedure: -> the
    recovery's end, or ``end_ms`` while it has not ended), resume (-> the job's first training
    step after it: recovered).  Empty phases are left out.

    >>> phases(dict(source_ts_ms=0, detected_ts_ms=500, decided_ts_ms=900, localised_s=0.9,
    ...             ended_ts_ms=1550, recovered_ts_ms=5100, outcome="succeeded"), 10_000)
    [('detect', 0, 500), ('localise', 500, 900), ('recover', 900, 1550), ('resume', 1550, 5100)]
    """
    src, det, dec = int(inc["source_ts_ms"]), int(inc["detected_ts_ms"]), int(inc["decided_ts_ms"])
    out = [("detect", src, det)]
    if inc.get("localised_s") is not None:
        out.append(("localise", det, dec))
    else:
        out.append(("decide", det, dec))
    ended = int(inc.get("ended_ts_ms") or 0) or end_ms
    rec = int(inc.get("recovered_ts_ms") or 0)
    if rec:
        # The first step may come before the procedure's end (its replenish step runs after the
        # restart): the job is training again from there on, whatever the procedure still does.
        out += [("recover", dec, min(ended, rec)), ("resume", ended, rec)]
    else:
        out.append(("recover", dec, ended))
    return [(n, a, b) for n, a, b in out if b > a]


def _job(store: ClickHouseStore, job: str, since_ms: int, window_ms: int) -> JobData:
    (e,) = named.get("ettr").run(store, job=job)
    curve = named.get("training_curve").run(store, job=job, since_ms=since_ms)
    return JobData(
        job=job,
        ettr=e,
        curve=downsample(curve),
        cumulative=downsample(cumulative_ettr(curve)),
        sliding=downsample(sliding_ettr_of(curve, window_ms)),
        points=len(curve),
    )


def _parse(evidence: str) -> dict[str, Any]:
    try:
        v = json.loads(evidence or "{}")
    except ValueError:
        return {"unparsed": evidence[:2000]}
    return v if isinstance(v, dict) else {"value": v}


def load(
    store: ClickHouseStore,
    job: str,
    *,
    since_ms: int = 0,
    baseline: str | None = None,
    window_ms: int = HOUR_MS,
    progress: Any = None,
) -> ReportData:
    """Everything the report shows for ``job`` (and ``baseline``'s curve, when given).

    ``progress(message)`` is called before each query: a report over a long job takes a while."""
    say = progress or (lambda _msg: None)
    say("training curve and ETTR")
    main = _job(store, job, since_ms, window_ms)
    base = None
    if baseline:
        say(f"baseline {baseline}")
        base = _job(store, baseline, since_ms, window_ms)
    say("incidents")
    incs = [
        i
        for i in named.get("incidents").run(store, job=job, since_ms=since_ms)
        if i["action"] not in NOT_ACTING
    ]
    steps_q = named.get("incident_steps")
    for i in incs:
        i["steps"] = steps_q.run(store, decision=i["decision_id"])
    say("decisions, evictions, standbys")
    decisions = named.get("decisions").run(store, job=job, since_ms=since_ms)
    for d in decisions:
        d["evidence"] = _parse(d["evidence"])
    evictions = named.get("evictions").run(store, job=job, since_ms=since_ms)
    evicted = {e["machine"] for e in evictions}
    transitions = [
        t for t in named.get("node_transitions").run(store, since_ms=since_ms) if t["node"] in evicted
    ]
    return ReportData(
        job=main,
        baseline=base,
        since_ms=since_ms,
        generated_ms=int(time.time() * 1000),
        incidents=incs,
        mttr=named.get("mttr_by_category").run(store, job=job, since_ms=since_ms),
        evictions=evictions,
        standbys=named.get("standby_use").run(store, job=job, since_ms=since_ms),
        decisions=decisions,
        detection_latency=named.get("detection_latency").run(store, job=job, since_ms=since_ms),
        loaders=named.get("loader_takeovers").run(store, job=job, since_ms=since_ms),
        node_transitions=transitions,
    )
