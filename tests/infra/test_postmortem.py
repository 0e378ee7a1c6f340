"""ETTR and incident timelines from ClickHouse (both engines)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from trainguard.commands.postmortem import postmortem
from trainguard.infra.clickhouse import named
from trainguard.infra.clickhouse.postmortem import ettr, incidents, sliding_ettr
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.config import load_settings
from trainguard.infra.report import data as report_data
from trainguard.infra.report.render import render
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
    # The procedure is done, but the job has not stepped since: not recovered yet.
    assert (d["detected_s"], d["localised_s"], d["decided_s"], d["recovered_s"]) == (0.8, 0.9, 0.9, None)
    assert d["procedure_s"] == 2.1
    assert d["outcome"] == "succeeded" and d["machines"] == ["m1"] and d["category"] == "gpu_unavailable"
    assert [s["step"] for s in d["steps"]] == ["recovery", "evict", "recovery"]
    store.insert_events(_steps("j", range(5, 7), T0 + 3_200))
    (inc,) = incidents(store, job="j")
    assert (inc.to_dict()["recovered_s"], inc.procedure_s) == (4.2, 2.1)


def _xid_incident(job: str) -> list[object]:
    """An Xid 79 on m0 at T0 (the kernel's line), evicted: detected at 0.99 s, decided at 1.03 s,
    the procedure (stop, evict, swap, restart) done 0.65 s later -- and rank 0 of the restarted
    job steps at 5.1 s (0.65 s and 5.1 s: the user trial's Xid).  The job stepped every 0.5 s
    before, and the old processes ended two more steps after the fault (0.3 s; 1.1 s, before the
    stop): neither is training again."""
    det = Detection(detection_id="xid-det", ts_ms=T0 + 990, job=job, kind="xid-79",
                    category="gpu_unavailable", severity=Severity.CRITICAL, action=Action.EVICT, node="m0",
                    source_ts_ms=T0)  # fmt: skip
    dec = Decision(decision_id="xid-dec", ts_ms=T0 + 1030, job=job, action=Action.EVICT,
                   targets=Targets(machines=["m0"], group_kind="machine"), detection_ids=["xid-det"])  # fmt: skip
    procedure = [
        ("recovery", ActionPhase.STARTED, 1040),
        ("stop", ActionPhase.SUCCEEDED, 1150),
        ("evict", ActionPhase.SUCCEEDED, 1190),
        ("swap_standbys", ActionPhase.SUCCEEDED, 1220),
        ("restart", ActionPhase.SUCCEEDED, 1300),
        ("replenish", ActionPhase.STARTED, 1310),
        ("recovery", ActionPhase.SUCCEEDED, 1680),
    ]
    acts = [
        ActionEvent(
            event_id=f"xid-a{n}",
            decision_id="xid-dec",
            ts_ms=T0 + at,
            job=job,
            step=step,
            phase=phase,
            action=Action.EVICT,
        )
        for n, (step, phase, at) in enumerate(procedure)
    ]
    old = [TrainingStep(job=job, rank=0, step=s, ts_ms=T0 + at, step_time_s=0.5)
           for s, at in zip(range(10, 17), (-2500, -2000, -1500, -1000, -500, 300, 1100), strict=True)]  # fmt: skip
    # restarted from the checkpoint after step 12: steps 13.. again
    new = [TrainingStep(job=job, rank=0, step=s, ts_ms=T0 + 5100 + (s - 13) * 500, step_time_s=0.5)
           for s in range(13, 17)]  # fmt: skip
    return [det, dec, *acts, *old, *new]


def test_recovered_is_the_first_step_after_the_fault_not_the_procedure(store: ClickHouseStore) -> None:
    store.insert_events(_xid_incident("xid-job"))
    (inc,) = incidents(store, job="xid-job")
    d = inc.to_dict()
    assert (d["detected_s"], d["decided_s"], d["recovered_s"], d["procedure_s"]) == (0.99, 1.03, 5.1, 0.65)
    obj = {"settings": replace(load_settings(environ={}), clickhouse=store.cfg)}
    out = CliRunner().invoke(postmortem, ["--job", "xid-job"], obj=obj)
    assert out.exit_code == 0, out.output
    assert "recovered 5.1s  (procedure 0.65s)  succeeded" in out.output
    assert "MTTR per category: gpu_unavailable 5.1s (n=1; procedure 0.65s)" in out.output
    js = CliRunner().invoke(postmortem, ["--job", "xid-job", "--json"], obj=obj)
    assert json.loads(js.output)["recovered_s"] == 5.1
    (mttr,) = named.get("mttr_by_category").run(store, job="xid-job")
    assert (mttr["recovered"], mttr["mttr_s"], mttr["procedure_s"]) == (1, 5.1, 0.65)
    # the report: its table, and the curve's phases (the procedure, then the wait for the first step)
    data = report_data.load(store, "xid-job")
    (row,) = data.incidents
    assert report_data.phases(row, T0 + 10_000)[-2:] == [
        ("recover", T0 + 1030, T0 + 1680),
        ("resume", T0 + 1680, T0 + 5100),
    ]
    page = render(data)
    assert "<th>recovered s</th><th>procedure s</th>" in page
    assert "<td class='num'>5.1</td><td class='num'>0.65</td>" in page


def test_recovered_when_the_job_steps_again_hours_later(store: ClickHouseStore) -> None:
    """A recovery that ended just before an hour's end, the job back two hours later (the query
    looks for the first step by the hour: the recovery's own hour has none after it)."""
    hour = 3_600_000
    h0 = -(-T0 // hour) * hour  # the first full hour after T0
    fault = h0 - 2000
    det = Detection(detection_id="late-det", ts_ms=fault + 500, job="late", kind="hang",
                    category="job_hang", severity=Severity.CRITICAL, action=Action.RESTART,
                    source_ts_ms=fault)  # fmt: skip
    dec = Decision(decision_id="late-dec", ts_ms=fault + 600, job="late", action=Action.RESTART,
                   detection_ids=["late-det"])  # fmt: skip
    end = ActionEvent(event_id="late-end", decision_id="late-dec", ts_ms=h0 - 500, job="late",
                      step="recovery", phase=ActionPhase.SUCCEEDED, action=Action.RESTART)  # fmt: skip
    before = _steps("late", range(5), h0 - 8000)  # up to h0 - 3000; and one more while it recovered:
    during = TrainingStep(job="late", rank=0, step=5, ts_ms=h0 - 1000, step_time_s=1.0)
    back = _steps("late", range(6, 9), h0 + 2 * hour + 6000)  # the first at h0 + 2 h + 7 s
    store.insert_events([det, dec, end, *before, during, *back])
    (inc,) = incidents(store, job="late")
    assert (inc.to_dict()["recovered_s"], inc.procedure_s) == (7209.0, 0.9)
