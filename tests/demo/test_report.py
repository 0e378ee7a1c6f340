"""The demo's summary: per-incident phases from ClickHouse, skipped faults, standby readiness."""

from __future__ import annotations

from pathlib import Path

from trainguard_demo.report import (
    END_OF_TIME_MS,
    build_summary,
    loader_takeover_since,
    recoveries_since,
    standby_readiness,
    stepping_after,
)

from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.schemas.control import ActionEvent, ActionPhase, Decision, Detection, Targets
from trainguard.schemas.enums import Action, Severity
from trainguard.schemas.workload import TrainingStep

T0 = 1_795_000_000_000
JOB = "demo-report"


def _rows(store: ClickHouseStore) -> None:
    """Steps every 0.5 s; an Xid at T0+10 s, detected at +1 s, decided at +1.5 s, recovered by a
    stop (1 s), evict (0.5 s), swap (1 s) and restart (2 s) ending at +7 s; steps again at +8 s."""
    steps = [
        TrainingStep(job=JOB, rank=0, step=i, ts_ms=T0 + 500 * (i + 1), step_time_s=0.5) for i in range(20)
    ]
    steps += [
        TrainingStep(job=JOB, rank=0, step=20 + i, ts_ms=T0 + 18_000 + 500 * i, step_time_s=0.5)
        for i in range(10)
    ]
    fault = T0 + 10_000
    det = Detection(
        detection_id="det-r",
        ts_ms=fault + 1_000,
        job=JOB,
        kind="xid-79",
        category="gpu_unavailable",
        severity=Severity.CRITICAL,
        action=Action.EVICT,
        node="m1",
        source_ts_ms=fault,
    )
    dec = Decision(
        decision_id="dec-r",
        ts_ms=fault + 1_500,
        job=JOB,
        action=Action.EVICT,
        targets=Targets(machines=["m1"], group_kind="machine"),
        detection_ids=["det-r"],
    )
    acts, t = [], fault + 1_600
    acts.append(_act("recovery", ActionPhase.STARTED, t, 0, "path=evict level=0"))
    for step, took in (("stop", 1_000), ("evict", 500), ("swap_standbys", 1_000), ("restart", 2_000)):
        acts.append(_act(step, ActionPhase.STARTED, t, 0))
        t += took
        acts.append(_act(step, ActionPhase.SUCCEEDED, t, took))
    acts.append(_act("recovery", ActionPhase.SUCCEEDED, t + 10, t - fault, "path=evict"))
    store.insert_events([*steps, det, dec, *acts])


def _act(step: str, phase: ActionPhase, ts: int, took: float, detail: str = "") -> ActionEvent:
    return ActionEvent(
        event_id=f"{step}-{phase.value}",
        decision_id="dec-r",
        ts_ms=ts,
        job=JOB,
        step=step,
        phase=phase,
        action=Action.EVICT,
        duration_ms=took,
        detail=detail,
    )


def test_the_summary_breaks_each_incident_into_phases_and_reports_skipped_faults(
    store: ClickHouseStore,
) -> None:
    _rows(store)
    injected = [
        {"fault": "xid", "machine": "m1", "injected_at": (T0 + 10_000) / 1000, "progressed": True},
        {"fault": "nan", "machine": "m2", "skipped": True},
    ]
    summary = build_summary(store, JOB, injected)
    xid, nan = summary["incidents"]
    assert xid["recovered"] and xid["action"] == "evict"
    phases = xid["phases"]
    assert phases["detect"] == 1.0 and phases["localise"] == 0.5 and phases["decide"] == 0.0
    assert phases["steps"] == {"stop": 1.0, "evict": 0.5, "swap_standbys": 1.0, "restart": 2.0}
    restart_end = T0 + 11_600 + 4_500
    assert phases["first_step"] == (T0 + 18_000 - restart_end) / 1000
    assert nan["recovered"] is False and nan["phases"] == {} and "not injected" in nan["action"]


def test_handled_means_stepping_after_the_restart(store: ClickHouseStore) -> None:
    """What the demo waits for before the next fault: the first step after the restart ended
    (a cold Slurm restart steps ~20 s after it), the same instant the timeline calls recovered."""
    _rows(store)
    recoveries = recoveries_since(store, JOB, T0 + 10_000)
    assert [r.phase for r in recoveries] == ["succeeded"]
    assert stepping_after(store, JOB, recoveries) == T0 + 18_000
    assert stepping_after(store, JOB, []) is None


def test_a_fault_no_recovery_carried_out_is_not_recovered(store: ClickHouseStore) -> None:
    """An Xid whose eviction was decided but never carried out (the action service was busy
    elsewhere) is not recovered because training went on; a flap is; a slow rank must be evicted."""
    job = "demo-report-unhandled"
    fault = T0 + 10_000
    steps = [
        TrainingStep(job=job, rank=0, step=i, ts_ms=T0 + 500 * (i + 1), step_time_s=0.5) for i in range(60)
    ]
    det = Detection(
        detection_id="det-u", ts_ms=fault + 1_000, job=job, kind="xid-79", category="gpu_unavailable",
        severity=Severity.CRITICAL, action=Action.EVICT, node="m1", source_ts_ms=fault,
    )  # fmt: skip
    dec = Decision(
        decision_id="dec-u", ts_ms=fault + 1_500, job=job, action=Action.EVICT,
        targets=Targets(machines=["m1"], group_kind="machine"), detection_ids=["det-u"],
    )  # fmt: skip
    store.insert_events([*steps, det, dec])
    injected = [
        {"fault": fault_kind, "machine": "m1", "injected_at": (fault + 5000 * i) / 1000, "progressed": True}
        for i, fault_kind in enumerate(("xid", "nic-flap", "slow"))
    ]
    xid, flap, slow = build_summary(store, job, injected)["incidents"]
    assert xid["action"] == "tolerated" and xid["recovered"] is False
    assert flap["recovered"] is True
    assert slow["recovered"] is False  # nothing evicted the slow rank


def test_standby_readiness_measures_provisioned_machines_only(tmp_path: Path) -> None:
    machines = tmp_path / "machines"
    for name, started, ready in (("standby-0", 100.0, [130.5, 131.0]), ("standby-1", 200.0, [210.0])):
        home = machines / name
        home.mkdir(parents=True)
        (home / "provisioned").write_text(f"{started}\n")
        for slot, ts in enumerate(ready):
            (home / f"ready.{slot}").write_text(f"{ts}\n")
    (machines / "m0").mkdir()  # started with the job: not a provisioned standby
    (machines / "m0" / "ready.0").write_text("1.0\n")
    out = standby_readiness(tmp_path, slots=2)
    assert out["ready_s"] == {"standby-0": 31.0, "standby-1": None}
    assert out["p50_s"] == 31.0 and out["max_s"] == 31.0 and out["never_ready"] == ["standby-1"]


def test_a_loader_taken_over_is_recovered_in_place(store: ClickHouseStore) -> None:
    """A hung loader its shadow loader took over: no recovery ran, the incident is recovered on the
    shadow-loader path at the first step after the takeover, and the wait for it ends then."""
    job = "demo-report-loader"
    fault = T0 + 10_000
    steps = [
        TrainingStep(job=job, rank=0, step=i, ts_ms=T0 + 500 * (i + 1), step_time_s=0.5) for i in range(21)
    ]  # the last one before the stall, at T0 + 10.5 s
    steps += [TrainingStep(job=job, rank=0, step=21 + i, ts_ms=fault + 2_400 + 500 * i) for i in range(10)]
    line = ("trainguard shadow loader: took over from loader 1 (stalled: no batch for 1.01 s, threshold "
            "1.00 s) with loader 2 in 0.040 s at epoch 0 sample 168 (consumed 168)")  # fmt: skip
    det = Detection(
        detection_id="det-l", ts_ms=fault + 2_600, job=job, kind="log_rule", category="loader_takeover",
        severity=Severity.WARNING, action=Action.IGNORE, node="m2", source_ts_ms=fault + 2_200,
        evidence={"rule": "shadow-loader-takeover", "line": line},
    )  # fmt: skip
    store.insert_events([*steps, det])
    injected = [
        {"fault": "hang-dataloader", "machine": "m2", "injected_at": fault / 1000, "progressed": True}
    ]
    (incident,) = build_summary(store, job, injected)["incidents"]
    assert incident["recovered"] and incident["action"] == "shadow-loader"
    assert (incident["detected_s"], incident["recovered_s"], incident["decided_s"]) == (2.6, 2.4, None)
    assert incident["phases"]["takeover"] == 2.2 and incident["phases"]["first_step"] == 0.2
    assert loader_takeover_since(store, job, fault, END_OF_TIME_MS) == fault + 2_200
    assert loader_takeover_since(store, job, fault + 3_000, END_OF_TIME_MS) is None
