"""Named SQL queries: every query file parses and runs on both engines with the answer it promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.detectors.node_inspector import NodeInspector
from trainguard.infra.clickhouse import named
from trainguard.infra.clickhouse.named import QueryError
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.schemas.base import Event
from trainguard.schemas.control import ActionEvent, ActionPhase, DeadLetter, Decision, Detection, Targets
from trainguard.schemas.enums import Action, Severity
from trainguard.schemas.telemetry import CheckAction, CheckOutcome, NodeCheck
from trainguard.schemas.workload import LogLine, TrainingStep
from trainguard.streams.shadow_loader import LoaderEvent

T0 = 1_795_000_000_000

ALL = named.load_all()


def test_the_package_ships_the_postmortem_queries() -> None:
    wanted = {
        "ettr",
        "training_curve",
        "incidents",
        "incident_steps",
        "mttr_by_category",
        "evictions",
        "decisions_for_machine",
        "detection_latency",
        "top_fault_machines",
        "standby_use",
        "placement",
        "loader_takeovers",
        "dead_letters",
        "node_checks",
        "node_transitions",
    }
    assert wanted <= set(ALL)
    for q in ALL.values():
        assert q.answers and q.sql and q.text.startswith("-- name:")


def _write(tmp_path: Path, name: str, text: str) -> Path:
    (tmp_path / f"{name}.sql").write_text(text)
    return tmp_path


def test_header_needs_name_and_answers(tmp_path: Path) -> None:
    with pytest.raises(QueryError, match="no '-- answers:' line"):
        named.load_all(_write(tmp_path, "a", "-- name: a\nSELECT 1"))


def test_parameters_used_must_be_declared(tmp_path: Path) -> None:
    with pytest.raises(QueryError, match=r"used \['job'\] but declared \[\]"):
        named.load_all(_write(tmp_path, "a", "-- name: a\n-- answers: x\nSELECT %(job)s"))


def test_bad_param_line_says_the_form(tmp_path: Path) -> None:
    with pytest.raises(QueryError, match="NAME TYPE"):
        named.load_all(_write(tmp_path, "a", "-- name: a\n-- answers: x\n-- param: job Strung\nSELECT 1"))


def test_includes_expand_and_inherit_defaults(tmp_path: Path) -> None:
    _write(tmp_path, "base", "-- name: base\n-- answers: x\n-- param: n Int64 = 3  n\nSELECT %(n)s AS n")
    _write(tmp_path, "top", "-- name: top\n-- answers: y\nSELECT n + 1 FROM ({{base}})")
    qs = named.load_all(tmp_path)
    assert "SELECT %(n)s AS n" in qs["top"].sql
    assert qs["top"].bind({}) == {"n": 3}
    with pytest.raises(QueryError, match="has no parameter n"):
        qs["top"].bind({"n": "4"})  # not the includer's to set


def test_include_cycles_and_unknown_includes_are_errors(tmp_path: Path) -> None:
    _write(tmp_path, "a", "-- name: a\n-- answers: x\nSELECT * FROM ({{b}})")
    _write(tmp_path, "b", "-- name: b\n-- answers: x\nSELECT * FROM ({{a}})")
    with pytest.raises(QueryError, match="includes itself"):
        named.load_all(tmp_path)
    (tmp_path / "b.sql").write_text("-- name: b\n-- answers: x\nSELECT * FROM ({{nope}})")
    with pytest.raises(QueryError, match="which is no query"):
        named.load_all(tmp_path)


def test_bind_parses_declared_types_and_names_what_is_missing() -> None:
    q = ALL["top_fault_machines"]
    assert q.bind({"limit": "5", "job": "j"}) == {"job": "j", "since_ms": 0, "limit": 5}
    with pytest.raises(QueryError, match="not a Int64"):
        q.bind({"limit": "many"})
    with pytest.raises(QueryError, match="needs --param job"):
        ALL["ettr"].bind({})
    with pytest.raises(QueryError, match="no parameter jbo; it takes job=String"):
        ALL["ettr"].bind({"jbo": "x"})


def test_unknown_query_lists_the_known_ones() -> None:
    with pytest.raises(QueryError, match=r"there are: .*ettr"):
        named.get("ettr2")


# --- every query on both engines -----------------------------------------------------------------


def _incident(i: int, machine: str, category: str, recovered_after_ms: int | None) -> list[object]:
    """A detection at T0+i*100 s (source 1 s before), its evict decision 0.5 s later, and the
    action service's events (evict, swap, recovery) -- unfinished when recovered_after_ms is None."""
    t = T0 + i * 100_000
    det = Detection(
        detection_id=f"det{i}",
        ts_ms=t,
        job="j",
        kind=f"{category}-rule",
        category=category,
        severity=Severity.CRITICAL,
        action=Action.EVICT,
        node=machine,
        source_ts_ms=t - 1000,
    )
    dec = Decision(
        decision_id=f"dec{i}",
        ts_ms=t + 500,
        job="j",
        action=Action.EVICT,
        targets=Targets(machines=[machine], group_kind="machine"),
        detection_ids=[f"det{i}"],
        reason=f"{category} on {machine}",
    )
    steps: list[tuple[str, ActionPhase, int, list[str], str]] = [
        ("recovery", ActionPhase.STARTED, 600, [], ""),
        ("evict", ActionPhase.SUCCEEDED, 1000, [machine], ""),
        (
            "swap_standbys",
            ActionPhase.SUCCEEDED,
            2000,
            [machine],
            f"['{machine}'] -> ['s{i}']; dp_spread {i + 1}->{i} pp_spread 2->1 ({'exact' if i < 3 else 'heuristic'})",
        ),
    ]
    if recovered_after_ms is not None:
        steps.append(("recovery", ActionPhase.SUCCEEDED, recovered_after_ms, [], ""))
    acts = [
        ActionEvent(
            event_id=f"a{i}-{n}",
            decision_id=f"dec{i}",
            ts_ms=t + off,
            job="j",
            step=step,
            phase=phase,
            action=Action.EVICT,
            duration_ms=100.0,
            detail=detail,
            targets=Targets(machines=ms),
        )
        for n, (step, phase, off, ms, detail) in enumerate(steps)
    ]
    return [det, dec, *acts]


def _step_after(i: int, after_ms: int) -> TrainingStep:
    """A training step of job ``j`` (rank 0) ending ``after_ms`` after incident ``i``'s detection."""
    return TrainingStep(job="j", rank=0, step=100 + i, ts_ms=T0 + i * 100_000 + after_ms, step_time_s=1.0)


@pytest.fixture
def incidents_store(store: ClickHouseStore) -> ClickHouseStore:
    store.insert_events(
        [
            *_incident(1, "m1", "gpu_unavailable", 9_000),  # procedure ended 10 s after the source
            *_incident(2, "m2", "gpu_unavailable", 19_000),  # 20 s
            *_incident(3, "m1", "nic", None),  # still pending
            *[
                TrainingStep(job="j", rank=0, step=s, ts_ms=T0 + (s + 1) * 1000, step_time_s=1.0, loss=2.0)
                for s in range(10)
            ],
            *[  # steps 7..9 recomputed after a restart from the checkpoint at step 6
                TrainingStep(job="j", rank=0, step=s, ts_ms=T0 + 15_000 + (s - 6) * 1000, step_time_s=1.0)
                for s in range(7, 12)
            ],
            DeadLetter(ts_ms=T0, topic="trainguard.telemetry.gpu", reason="bad json", payload="{x"),
            DeadLetter(ts_ms=T0 + 1, topic="trainguard.telemetry.gpu", reason="bad json", offset=3),
        ]
    )
    return store


def test_incidents_and_mttr_agree(incidents_store: ClickHouseStore) -> None:
    # The job steps again 2 s after dec1's procedure ended and 3 s after dec2's.  The step that
    # ended while dec1's procedure ran (it restarted nothing) and the one during the pending dec3
    # are not training again.
    incidents_store.insert_events(
        [_step_after(1, 700), _step_after(1, 11_000), _step_after(2, 22_000), _step_after(3, 5_000)]
    )
    rows = ALL["incidents"].run(incidents_store, job="j")
    assert [r["decision_id"] for r in rows] == ["dec1", "dec2", "dec3"]
    r1 = rows[0]
    assert (r1["detected_s"], r1["localised_s"], r1["decided_s"], r1["recovered_s"]) == (1.0, 1.5, 1.5, 12.0)
    assert (r1["procedure_s"], r1["ended_ts_ms"], rows[1]["recovered_s"]) == (8.5, T0 + 109_000, 23.0)
    assert (r1["category"], r1["kind"], r1["outcome"], list(r1["machines"])) == (
        "gpu_unavailable",
        "gpu_unavailable-rule",
        "succeeded",
        ["m1"],
    )
    assert rows[2]["outcome"] == "pending" and rows[2]["recovered_s"] is None
    assert rows[2]["procedure_s"] is None and rows[2]["ended_ts_ms"] == 0
    assert [r["decision_id"] for r in ALL["incidents"].run(incidents_store, decision="dec2")] == ["dec2"]
    assert ALL["incidents"].run(incidents_store, since_ms=T0 + 150_000)[0]["decision_id"] == "dec2"
    mttr = {r["fault"]: r for r in ALL["mttr_by_category"].run(incidents_store, job="j")}
    assert (mttr["gpu_unavailable"]["incidents"], mttr["gpu_unavailable"]["recovered"]) == (2, 2)
    assert mttr["gpu_unavailable"]["mttr_s"] == pytest.approx(17.5)
    assert mttr["gpu_unavailable"]["worst_s"] == pytest.approx(23.0)
    assert mttr["gpu_unavailable"]["procedure_s"] == pytest.approx(13.5)
    assert (mttr["nic"]["incidents"], mttr["nic"]["recovered"]) == (1, 0)


def test_incident_steps_evictions_and_standbys(incidents_store: ClickHouseStore) -> None:
    steps = ALL["incident_steps"].run(incidents_store, decision="dec1")
    assert [(s["step"], s["phase"]) for s in steps] == [
        ("recovery", "started"),
        ("evict", "succeeded"),
        ("swap_standbys", "succeeded"),
        ("recovery", "succeeded"),
    ]
    ev = ALL["evictions"].run(incidents_store, job="j")
    assert [(e["machine"], e["decision_id"], e["category"], e["outcome"]) for e in ev] == [
        ("m1", "dec1", "gpu_unavailable", "succeeded"),
        ("m2", "dec2", "gpu_unavailable", "succeeded"),
        ("m1", "dec3", "nic", "pending"),
    ]
    swaps = ALL["standby_use"].run(incidents_store, job="j")
    assert [s["detail"].split(";")[0] for s in swaps] == [
        "['m1'] -> ['s1']",
        "['m2'] -> ['s2']",
        "['m1'] -> ['s3']",
    ]
    spread = ALL["placement"].run(incidents_store, job="j")
    assert [
        (
            r["decision_id"],
            r["dp_spread_before"],
            r["dp_spread_after"],
            r["pp_spread_before"],
            r["pp_spread_after"],
            r["method"],
        )
        for r in spread
    ] == [("dec1", 2, 1, 2, 1, "exact"), ("dec2", 3, 2, 2, 1, "exact"), ("dec3", 4, 3, 2, 1, "heuristic")]


def test_machines_view(incidents_store: ClickHouseStore) -> None:
    decs = ALL["decisions_for_machine"].run(incidents_store, machine="m1")
    assert [d["decision_id"] for d in decs] == ["dec3", "dec1"]  # newest first
    top = ALL["top_fault_machines"].run(incidents_store, job="j")
    assert [(t["machine"], t["evictions"], t["detections"]) for t in top] == [("m1", 2, 2), ("m2", 1, 1)]
    assert sorted(top[0]["categories"]) == ["gpu_unavailable", "nic"]
    assert len(ALL["top_fault_machines"].run(incidents_store, limit=1)) == 1


def test_detection_latency(incidents_store: ClickHouseStore) -> None:
    lat = ALL["detection_latency"].run(incidents_store, job="j")
    assert {(r["kind"], r["detections"], r["p50_s"], r["max_s"]) for r in lat} == {
        ("gpu_unavailable-rule", 2, 1.0, 1.0),
        ("nic-rule", 1, 1.0, 1.0),
    }


def test_ettr_and_training_curve(incidents_store: ClickHouseStore) -> None:
    (e,) = ALL["ettr"].run(incidents_store, job="j")
    # 12 surviving steps of 1 s; wall from T0 to the last step's end at T0+20 s; 3 recomputed.
    assert (e["steps"], e["recomputed_steps"]) == (12, 3)
    assert e["productive_s"] == pytest.approx(12.0) and e["wall_s"] == pytest.approx(20.0)
    assert e["ettr"] == pytest.approx(0.6)
    curve = ALL["training_curve"].run(incidents_store, job="j")
    assert len(curve) == 15
    assert [c["step"] for c in curve if not c["survived"]] == [7, 8, 9]


def test_dead_letters(incidents_store: ClickHouseStore) -> None:
    (dl,) = ALL["dead_letters"].run(incidents_store)
    assert (dl["topic"], dl["reason"], dl["records"]) == ("trainguard.telemetry.gpu", "bad json", 2)


def test_node_checks(store: ClickHouseStore) -> None:
    """Preflight records of three runs on two nodes: the failing one listed, the passing ones only
    with failed_only = 0, and one node's alone."""
    checks: list[Event] = [
        NodeCheck(check_id="c1", node="n1", ts_ms=T0, origin="slurm-prolog", job="41", outcome=CheckOutcome.FAILED,
                  action=CheckAction.DRAINED, failed_tests=["gemm-digest"], reason="trainguard preflight: gemm-digest: x"),
        NodeCheck(check_id="c2", node="n2", ts_ms=T0 + 1, origin="slurm-prolog", job="41"),
        NodeCheck(check_id="c3", node="n2", ts_ms=T0 + 2, origin="k8s-init", job="llm-0"),
    ]  # fmt: skip
    store.insert_events(checks + checks[:1])  # a record resent after an outage stays one row
    (bad,) = ALL["node_checks"].run(store)
    assert (bad["node"], bad["job"], bad["outcome"], bad["action"], bad["failed_tests"]) == (
        "n1",
        "41",
        "failed",
        "drained",
        ["gemm-digest"],
    )
    assert [r["ts_ms"] for r in ALL["node_checks"].run(store, failed_only=0)] == [T0 + 2, T0 + 1, T0]
    assert [r["origin"] for r in ALL["node_checks"].run(store, node="n2", failed_only=0)] == [
        "k8s-init",
        "slurm-prolog",
    ]


def test_every_query_runs_on_an_empty_database(store: ClickHouseStore) -> None:
    for q in ALL.values():
        required = {p.name: ("x" if p.type == "String" else "0") for p in q.params if p.default is None}
        cols, rows = q.run_rows(store, **required)  # (18.16 sends no column names with no rows)
        if q.name == "ettr":
            assert rows[0][cols.index("ettr")] == 0
        else:
            assert rows == [], q.name


def test_loader_takeovers(store: ClickHouseStore) -> None:
    """The shadow loader's lines, as a rank's reporter sends them and the worker's node inspector
    turns them into detections (a takeover on n2, a give-up on n5), listed with their numbers."""
    inspector = NodeInspector()
    events = [
        LoaderEvent("takeover", "stalled", stalled_s=1.03, threshold_s=1.0, takeover_s=0.041, from_lane=1,
                    to_lane=2, epoch=2, offset=64, consumed=1184),
        LoaderEvent("gave_up", "died", stalled_s=0.2, from_lane=4, takeovers=3, epoch=0, offset=8),
    ]  # fmt: skip
    dets = []
    for i, (node, rank, event) in enumerate([("n2", 4, events[0]), ("n5", 1, events[1])]):
        line = LogLine(node=node, ts_ms=T0 + i * 1000, source="trainguard", line=event.line(), job="jl",
                       rank=rank, seq=i + 1)  # fmt: skip
        dets += inspector.inspect(line, T0 + i * 1000 + 200)
    store.insert_events(dets)
    rows = ALL["loader_takeovers"].run(store, job="jl")
    assert [
        (r["node"], r["rank"], r["event"], r["reason"], r["stalled_s"], r["takeover_s"]) for r in rows
    ] == [
        ("n2", 4, "loader_takeover", "stalled", 1.03, 0.041),
        ("n5", 1, "loader_failed", "died", 0.0, 0.0),
    ]
    assert rows[0]["ts_ms"] == T0 and rows[0]["line"] == events[0].line()
    assert ALL["loader_takeovers"].run(store, job="jl", since_ms=T0 + 500)[0]["node"] == "n5"
