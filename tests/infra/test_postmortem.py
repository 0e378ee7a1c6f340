"""ETTR and incident timelines from ClickHouse (both engines)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainguard.infra.clickhouse.postmortem import ettr, incidents, sliding_ettr
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.schemas.control import ActionEvent, ActionPhase, Decision, Detection, Targets
from trainguard.schemas.enums import Action, Severity
from trainguard.schemas.workload import TrainingStep

T0 = 1_795_000_000_000


def _steps(job: str, steps: range, start_ms: int, step_s: float = 1.0) -> list[TrainingStep]:
    return [
        TrainingStep(
            job=job, rank=0, step=s, ts_ms=start_ms + int((i + 1) * step_s * 1000), step_time_s=step_s
        )
        for i, s in enumerate(steps)
    ]


def test_ettr_counts_recomputed_steps_and_downtime_as_unproductive(store: ClickHouseStore) -> None:
    # Steps 0..9 at 1 s each (t=0..10 s); crash; 5 s down; restart from the checkpoint after step 6
    # and recompute steps 7..9, then 10..19.  Productive: 20 steps = 20 s.  Wall: 10 + 5 + 13 = 28 s.
    run1 = _steps("j", range(10), T0)
    run2 = _steps("j", range(7, 20), T0 + 15_000)
    store.insert_events([*run1, *run2])
    e = ettr(store, "j")
    assert e.steps == 20 and e.recomputed_steps == 3
    assert e.productive_s == pytest.approx(20.0)
    assert e.wall_s == pytest.approx(28.0)
    assert e.ettr == pytest.approx(20 / 28)
    windows = sliding_ettr(store, "j", window_ms=10_000)
    assert windows[-1][1] == pytest.approx(1.0)  # the last 10 s were all productive
    assert min(w for _, w in windows) < 0.7  # the window over the outage was not


def test_ettr_does_not_count_steps_with_a_nan_loss(store: ClickHouseStore) -> None:
    # 10 steps of 1 s; steps 6..9 trained on through a NaN loss and were never recomputed.
    steps = [replace(e, loss=float("nan") if e.step >= 6 else 2.0) for e in _steps("nan-job", range(10), T0)]
    store.insert_events(steps)
    e = ettr(store, "nan-job")
    assert e.productive_s == pytest.approx(6.0) and e.wall_s == pytest.approx(10.0)


def test_ettr_of_unknown_job_is_zero(store: ClickHouseStore) -> None:
    assert ettr(store, "nope").ettr == 0.0 and sliding_ettr(store, "nope") == []


def test_incident_timeline_joins_detection_decision_and_actions(store: ClickHouseStore) -> None:
    det = Detection(
        detection_id="det1",
        ts_ms=T0 + 800,
        job="j",
        kind="xid-79",
        category="gpu_unavailable",
        severity=Severity.CRITICAL,
        action=Action.EVICT,
        node="m1",
        source_ts_ms=T0,
    )
    dec = Decision(
        decision_id="dec1",
        ts_ms=T0 + 900,
        job="j",
        action=Action.EVICT,
        targets=Targets(machines=["m1"], group_kind="machine"),
        detection_ids=["det1"],
        evidence={"detection": {"kind": "xid-79", "category": "gpu_unavailable", "source_ts_ms": T0}},
    )
    acts = [
        ActionEvent(
            event_id=f"a{i}",
            decision_id="dec1",
            ts_ms=T0 + 1000 + i * 1000,
            job="j",
            step=step,
            phase=phase,
            action=Action.EVICT,
        )
        for i, (step, phase) in enumerate(
            [
                ("recovery", ActionPhase.STARTED),
                ("evict", ActionPhase.SUCCEEDED),
                ("recovery", ActionPhase.SUCCEEDED),
            ]
        )
    ]
    store.insert_events([det, dec, *acts])
    (inc,) = incidents(store, job="j")
    d = inc.to_dict()
    assert (d["detected_s"], d["localised_s"], d["decided_s"], d["recovered_s"]) == (0.8, 0.9, 0.9, 3.0)
    assert d["outcome"] == "succeeded" and d["machines"] == ["m1"] and d["category"] == "gpu_unavailable"
    assert [s["step"] for s in d["steps"]] == ["recovery", "evict", "recovery"]
