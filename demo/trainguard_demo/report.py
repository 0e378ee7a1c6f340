"""The result of `trainguard demo`: each incident's timeline and the ETTR, measured from ClickHouse.

:func:`build_summary` turns the injections of a finished run into the summary JSON
(``--summary-json``) and :func:`print_timeline` prints it.  Timeline columns, all relative to the
injection: *detected* (the first actionable detection, or the machine's own NIC finding for a
flap that is tolerated), *localised* (the first decision that names the culprit machines),
*decided* (the first decision that starts a recovery), *recovered* (the first training step after
the last of those recoveries ended: training is running again, not merely "the action service is
done").

:func:`recoveries_since` and :func:`first_step_after` also tell the scenario loop
(:mod:`trainguard_demo.run`) when a fault has been handled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import click

from trainguard.infra.clickhouse.postmortem import ettr, sliding_ettr
from trainguard.infra.clickhouse.store import ClickHouseStore

if TYPE_CHECKING:
    from trainguard_demo.baseline import BaselineSupervisor

#: Decision actions that start no recovery.
NOT_ACTING = ("aggregate", "none", "ignore")

#: Faults the job is meant to ride out with no recovery (a single short NIC flap); every other
#: fault counts as recovered only once a recovery of it succeeded -- a decision the action service
#: never carried out is a failure even if training happened to go on.
TOLERATED = ("nic-flap",)
#: Faults whose recovery must take a given path: a fail-slow rank is removed, not waited out.
REQUIRED_PATH = {"slow": "evict"}
#: The path of a hung loader taken over by the rank's shadow loader (no recovery by the service).
IN_PLACE_LOADER = "shadow-loader"

#: Later than any injection: the upper bound of the last incident's window.
END_OF_TIME_MS = 1 << 62


class Recovery(NamedTuple):
    """One decision's recovery as the action service reported it."""

    decision_id: str
    action: str
    phase: str  # the last recovery phase reported: started, succeeded, failed, held, ...
    ts_ms: int  # when that phase was reported


def recoveries_since(store: ClickHouseStore, job: str, t_ms: int) -> list[Recovery]:
    """The recovery of each decision for ``job`` since ``t_ms``."""
    rows = store.query(
        # One row per decision on each side: ANY JOIN keeps a single right-hand match.
        "SELECT decision_id, d.action, a.phase, a.ts FROM "
        "(SELECT decision_id, any(action) AS action FROM decisions FINAL "
        " WHERE job = %(j)s AND ts_ms >= %(t)s GROUP BY decision_id) AS d ANY INNER JOIN "
        "(SELECT decision_id, argMax(phase, ts_ms) AS phase, max(ts_ms) AS ts FROM action_events FINAL "
        " WHERE job = %(j)s AND step = 'recovery' GROUP BY decision_id) AS a USING decision_id",
        {"j": job, "t": t_ms},
    )
    return [
        Recovery(str(decision_id), str(action), str(phase), int(ts))
        for decision_id, action, phase, ts in rows
    ]


def loader_takeover_since(store: ClickHouseStore, job: str, t_ms: int, t_next: int) -> int | None:
    """When (the rank's own clock, ms) a shadow loader of ``job`` first took over a hung or dead
    loader in ``[t_ms, t_next)`` as TrainGuard recorded it (rule ``shadow-loader-takeover``)."""
    rows = store.query(
        "SELECT min(source_ts_ms) FROM detections FINAL WHERE job = %(j)s AND ts_ms >= %(t)s "
        "AND ts_ms < %(n)s AND category = 'loader_takeover'",
        {"j": job, "t": t_ms, "n": t_next},
    )
    return int(rows[0][0]) if rows and rows[0][0] else None


def first_step_after(store: ClickHouseStore, job: str, ts_ms: int) -> int | None:
    """When rank 0 of ``job`` reported its first training step after ``ts_ms``."""
    rows = store.query(
        "SELECT min(ts_ms) FROM training_steps WHERE job = %(j)s AND rank = 0 AND ts_ms > %(t)s",
        {"j": job, "t": ts_ms},
    )
    return int(rows[0][0]) if rows and rows[0][0] else None


def build_summary(
    store: ClickHouseStore,
    job: str,
    injected: list[dict[str, Any]],
    baseline: BaselineSupervisor | None = None,
) -> dict[str, Any]:
    """The summary JSON: every incident's timeline, the ETTRs, and the baseline's when it ran.

    ``injected`` lists the scenario's injections in order (``fault``, ``machine``,
    ``injected_at`` in seconds, ``progressed``); each incident's window ends at the next one.
    """
    incidents = []
    for index, injection in enumerate(injected):
        later = (int(i["injected_at"] * 1000) for i in injected[index + 1 :] if not i.get("skipped"))
        t_next = next(later, END_OF_TIME_MS)
        incidents.append(_incident(store, job, injection, t_next))
    job_ettr = ettr(store, job)
    summary: dict[str, Any] = {
        "job": job,
        "ettr": round(job_ettr.ettr, 4),
        "baseline_ettr": None,
        "productive_s": round(job_ettr.productive_s, 1),
        "wall_s": round(job_ettr.wall_s, 1),
        "sliding_ettr_min": _min_sliding(store, job),
        "incidents": incidents,
    }
    if baseline is not None:
        baseline_ettr = ettr(store, baseline.spec.job)
        summary["baseline_ettr"] = round(baseline_ettr.ettr, 4)
        summary["baseline"] = {
            "job": baseline.spec.job,
            "productive_s": round(baseline_ettr.productive_s, 1),
            "wall_s": round(baseline_ettr.wall_s, 1),
            "requeues": baseline.requeues,
            "incidents": baseline.incidents(),
        }
    return summary


def _incident(store: ClickHouseStore, job: str, injection: dict[str, Any], t_next: int) -> dict[str, Any]:
    """One incident's timeline: what happened between its injection and ``t_next``."""
    if injection.get("skipped"):
        return {
            "fault": injection["fault"],
            "machine": injection["machine"],
            "injected_at": None,
            "detected_s": None,
            "localised_s": None,
            "decided_s": None,
            "recovered_s": None,
            "action": "not injected (demo budget spent)",
            "recovered": False,
            "phases": {},
        }
    t_ms = int(injection["injected_at"] * 1000)
    detected_ms = _first_ts(
        store,
        "SELECT min(ts_ms) FROM detections FINAL WHERE job = %(j)s AND ts_ms >= %(t)s "
        "AND ts_ms < %(n)s AND (action NOT IN ('none', 'ignore') "
        "OR (node = %(m)s AND kind LIKE 'nic-%%') OR category = 'loader_takeover')",
        job, t_ms, t_next, m=injection["machine"],
    )  # fmt: skip
    localised_ms = _first_ts(
        store,
        "SELECT min(ts_ms) FROM decisions FINAL WHERE job = %(j)s AND ts_ms >= %(t)s "
        "AND ts_ms < %(n)s AND notEmpty(machines) AND action NOT IN ('none', 'ignore')",
        job, t_ms, t_next,
    )  # fmt: skip
    recoveries = [rec for rec in recoveries_since(store, job, t_ms) if rec.ts_ms < t_next]
    acting = sorted((rec for rec in recoveries if rec.action not in NOT_ACTING), key=lambda rec: rec.ts_ms)
    decided_ms = _first_ts(
        store,
        "SELECT min(ts_ms) FROM decisions FINAL WHERE job = %(j)s AND ts_ms >= %(t)s "
        "AND ts_ms < %(n)s AND has(%(ids)s, decision_id)",
        job, t_ms, t_next, ids=[rec.decision_id for rec in acting] or [""],
    )  # fmt: skip
    succeeded = [
        rec for rec in acting if rec.phase == "succeeded" and not _superseded(store, rec.decision_id)
    ]
    decided_by = _decided_by(store, job, decided_ms) if decided_ms is not None else None
    # Stepping again after the last restart -- not after the recovery's end: its replenish step
    # may wait for that first step, and the step after the end is a later one.
    steps = _step_rows(store, succeeded)
    after = _restart_end(steps) or max((rec.ts_ms for rec in succeeded), default=None)
    action = _recovery_path(store, succeeded[0].decision_id) if succeeded else None
    # A hung loader its shadow loader took over: recovered in place, by the rank, at the takeover.
    takeover_ms = None if acting else loader_takeover_since(store, job, t_ms, t_next)
    if takeover_ms is not None:
        after, action = takeover_ms, IN_PLACE_LOADER
    recovered_ms = first_step_after(store, job, after) if after is not None else None
    failed = [rec for rec in acting if rec.phase in ("failed", "held")]

    def since_injection(ms: int | None) -> float | None:
        return None if ms is None else round((ms - t_ms) / 1000, 2)

    return {
        "fault": injection["fault"],
        "machine": injection["machine"],
        "injected_at": round(injection["injected_at"], 3),
        "detected_s": since_injection(detected_ms),
        "localised_s": since_injection(localised_ms),
        "decided_s": since_injection(decided_ms),
        "recovered_s": since_injection(recovered_ms),
        "action": action or ("tolerated" if detected_ms and not acting else None),
        "decided_by": decided_by,
        "recovered": _recovered(injection, failed, action),
        "phases": _phases(t_ms, detected_ms, localised_ms, decided_ms, recovered_ms, steps, takeover_ms),
    }


def _decided_by(store: ClickHouseStore, job: str, ts_ms: int) -> str | None:
    """What the decision the recovery carried out came from: the detection's kind, and for a stack
    capture's verdict the witnesses that decided it (``stacks``, ``flight_recorder``, ``both``,
    ``union``)."""
    rows = store.query(
        "SELECT evidence FROM decisions FINAL WHERE job = %(j)s AND ts_ms = %(t)s "
        "AND notEmpty(machines) LIMIT 1",
        {"j": job, "t": ts_ms},
    )
    if not rows:
        return None
    try:
        evidence = json.loads(rows[0][0])
    except (TypeError, ValueError):
        return None
    kind = str((evidence.get("detection") or {}).get("kind") or "")
    witnesses = (evidence.get("analysis") or {}).get("decided_by")
    return f"{kind} ({witnesses})" if witnesses else kind or None


def stepping_after(store: ClickHouseStore, job: str, recoveries: list[Recovery]) -> int | None:
    """When ``job`` took its first step after the last restart of these succeeded recoveries
    (after their end when they restarted nothing): what the timeline calls recovered.  The end
    of a recovery is not enough -- a restart returns once the scheduler runs the new processes,
    and under Slurm they take ~20 s more to step (a cold start)."""
    succeeded = [rec for rec in recoveries if rec.phase == "succeeded"]
    if not succeeded:  # failed or held: whether training went on regardless, after their end
        return first_step_after(store, job, max(rec.ts_ms for rec in recoveries)) if recoveries else None
    after = _restart_end(_step_rows(store, succeeded)) or max(rec.ts_ms for rec in succeeded)
    return first_step_after(store, job, after)


def _step_rows(store: ClickHouseStore, succeeded: list[Recovery]) -> list[tuple[str, float, int]]:
    """(step, total ms, last end ts_ms) of every succeeded step of these recoveries."""
    if not succeeded:
        return []
    rows = store.query(
        "SELECT step, sum(duration_ms), max(ts_ms) FROM action_events FINAL WHERE has(%(ids)s, decision_id) "
        "AND phase = 'succeeded' AND step != 'recovery' GROUP BY step",
        {"ids": [rec.decision_id for rec in succeeded]},
    )
    return [(str(step), float(ms), int(end)) for step, ms, end in rows]


def _restart_end(steps: list[tuple[str, float, int]]) -> int | None:
    """When the last restart step of :func:`_step_rows` ended (None: they restarted nothing)."""
    return max((end for step, _, end in steps if step == "restart"), default=None)


def _recovered(injection: dict[str, Any], failed: list[Recovery], action: str | None) -> bool:
    """Training went on after the fault, no recovery of it failed or is held, and -- unless the
    fault is one to tolerate -- a recovery of it succeeded, on the path the fault requires."""
    fault = injection["fault"]
    if not injection["progressed"] or failed:
        return False
    if fault in TOLERATED:
        return True
    return action is not None and REQUIRED_PATH.get(fault, action) == action


def _phases(
    t_ms: int,
    detected_ms: int | None,
    localised_ms: int | None,
    decided_ms: int | None,
    recovered_ms: int | None,
    steps: list[tuple[str, float, int]],
    takeover_ms: int | None = None,
) -> dict[str, Any]:
    """Where the incident's time went, in seconds: detect (injection -> first detection),
    localise (-> first decision naming machines), decide (-> the acting decision), each recovery
    step as the action service timed it (``steps``: :func:`_step_rows`), and the first step (the
    restart's end -> the first training step after it).  For a loader the shadow loader took over,
    ``takeover`` (injection -> the takeover: the fault firing, the prefetched batches consumed, the
    stall threshold, the standby's first batch) and the first step after it."""

    def span(start: int | None, end: int | None) -> float | None:
        return None if start is None or end is None else round(max(0, end - start) / 1000, 2)

    out = {
        "detect": span(t_ms, detected_ms),
        "localise": span(detected_ms, localised_ms) if localised_ms else None,
        "decide": span(localised_ms or detected_ms, decided_ms),
        "steps": {step: round(ms / 1000, 2) for step, ms, _ in steps},
        "first_step": span(_restart_end(steps) or takeover_ms, recovered_ms),
    }
    if takeover_ms is not None:
        out["takeover"] = span(t_ms, takeover_ms)
    return out


def _first_ts(
    store: ClickHouseStore, sql: str, job: str, t_ms: int, t_next: int, **params: Any
) -> int | None:
    """The single timestamp ``sql`` selects for ``job`` in the window ``[t_ms, t_next)``."""
    rows = store.query(sql, {"j": job, "t": t_ms, "n": t_next, **params})
    return int(rows[0][0]) if rows and rows[0][0] else None


def _superseded(store: ClickHouseStore, decision_id: str) -> bool:
    """Whether the decision's recovery was superseded or ignored rather than carried out."""
    rows = store.query(
        "SELECT count() FROM action_events FINAL WHERE decision_id = %(d)s AND step = 'recovery' "
        "AND (detail LIKE 'superseded%%' OR detail LIKE 'ignored%%')",
        {"d": decision_id},
    )
    return bool(rows and rows[0][0])


def _recovery_path(store: ClickHouseStore, decision_id: str) -> str | None:
    """The recovery path (``path=...`` of its start event) the decision's recovery took."""
    rows = store.query(
        "SELECT detail FROM action_events FINAL WHERE decision_id = %(d)s AND step = 'recovery' "
        "AND phase = 'started'",
        {"d": decision_id},
    )
    detail = str(rows[0][0]) if rows else ""
    return detail.split("path=")[1].split()[0] if "path=" in detail else None


def standby_readiness(cluster: Path, slots: int) -> dict[str, Any]:
    """How long each standby provisioned during the run took from its start to ready (every slot
    of its first warm pool waiting for activation), under the run's load; None: never ready."""
    times: dict[str, float | None] = {}
    for home in sorted((cluster / "machines").glob("*/provisioned")):
        machine = home.parent
        try:
            started = float(home.read_text())
            ready = [float(p.read_text()) for p in machine.glob("ready.*")]
        except (OSError, ValueError):
            continue
        times[machine.name] = round(max(ready) - started, 1) if len(ready) >= slots else None
    measured = sorted(t for t in times.values() if t is not None)
    return {
        "ready_s": times,
        "p50_s": measured[len(measured) // 2] if measured else None,
        "max_s": measured[-1] if measured else None,
        "never_ready": sorted(m for m, t in times.items() if t is None),
    }


def _min_sliding(store: ClickHouseStore, job: str) -> float | None:
    """The lowest 1-hour sliding ETTR (windows start at the first step: a run shorter than an hour
    gives the ETTR of every prefix)."""
    windows = sliding_ettr(store, job)
    return round(min(window for _, window in windows), 4) if windows else None


def print_timeline(summary: dict[str, Any], echo: Any = click.echo) -> None:
    """Print the summary of :func:`build_summary`: the incident table, then the ETTRs."""
    echo("\nIncident timeline (seconds after injection)")
    echo(
        f"{'fault':<17}{'machine':<16}{'detected':>9}{'localised':>10}{'decided':>9}{'recovered':>10}"
        f"  {'action':<14}ok   decided by"
    )

    def seconds(value: Any) -> str:
        return "-" if value is None else f"{value:.1f}"

    for incident in summary["incidents"]:
        echo(
            f"{incident['fault']:<17}{incident['machine']:<16}{seconds(incident['detected_s']):>9}"
            f"{seconds(incident['localised_s']):>10}{seconds(incident['decided_s']):>9}"
            f"{seconds(incident['recovered_s']):>10}  {incident['action']!s:<14}"
            f"{'yes' if incident['recovered'] else 'NO':<5}{incident.get('decided_by') or '-'}"
        )
    echo(
        f"\nETTR (ClickHouse): {summary['ettr']:.1%} over {summary['wall_s']:.0f}s wall "
        f"({summary['productive_s']:.0f}s productive)"
    )
    if summary.get("sliding_ettr_min") is not None:
        echo(f"Lowest 1-hour sliding ETTR: {summary['sliding_ettr_min']:.1%}")
    standbys = summary.get("standbys") or {}
    if standbys.get("ready_s"):
        echo(
            f"Standby time to ready under load: p50 {standbys['p50_s']} s, max {standbys['max_s']} s "
            f"over {len(standbys['ready_s'])} provisioned; never ready: {standbys['never_ready'] or 'none'}"
        )
    baseline = summary.get("baseline")
    if baseline:
        echo(
            f"Baseline ETTR (same scenario; timeout detection, {baseline['requeues']} cold requeue(s); "
            f"measured the same way): {summary['baseline_ettr']:.1%} over {baseline['wall_s']:.0f}s wall "
            f"({baseline['productive_s']:.0f}s productive)"
        )
    else:
        echo("Baseline: not run (--no-baseline)")
    if summary.get("report"):
        echo(f"Report: {summary['report']}")
