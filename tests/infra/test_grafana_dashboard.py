"""The Grafana dashboard (infra/deploy/grafana): an importable dashboard whose every panel has a
data source input and a query, whose Prometheus queries name only metrics the components expose,
and whose ClickHouse queries run against the real schema (macros expanded as the plugin does)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.infra.metric_names import DEPLOY, component_names, used
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.control import ActionEvent, ActionPhase, Decision, Targets
from trainguard.schemas.enums import Action
from trainguard.schemas.workload import TrainingStep

DASHBOARD = DEPLOY / "grafana" / "trainguard-dashboard.json"
PROMETHEUS = "prometheus"
CLICKHOUSE = "grafana-clickhouse-datasource"


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def queries(plugin: str) -> list[tuple[str, str]]:
    """(panel title, query) of every target of a ``plugin`` data source."""
    key = "expr" if plugin == PROMETHEUS else "rawSql"
    return [(p["title"], t[key]) for p in panels() for t in p["targets"] if t["datasource"]["type"] == plugin]


def test_it_is_an_importable_dashboard_with_two_data_source_inputs() -> None:
    d = dashboard()
    assert d["schemaVersion"] >= 39 and d["uid"] == "trainguard" and d["title"]
    inputs = {i["name"]: i["pluginId"] for i in d["__inputs"]}
    assert inputs == {"DS_PROMETHEUS": PROMETHEUS, "DS_CLICKHOUSE": CLICKHOUSE}
    assert {r["id"] for r in d["__requires"] if r["type"] == "datasource"} == {PROMETHEUS, CLICKHOUSE}
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    # Nothing overlaps on the 24-column grid.
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine


def test_every_panel_has_a_data_source_input_and_a_query() -> None:
    uids = {PROMETHEUS: "${DS_PROMETHEUS}", CLICKHOUSE: "${DS_CLICKHOUSE}"}
    for p in panels():
        assert p["title"] and p["description"], p
        assert p["targets"], f"{p['title']} has no query"
        for t in [p, *p["targets"]]:
            ds = t["datasource"]
            assert uids.get(ds["type"]) == ds["uid"], f"{p['title']}: data source {ds}"
        for t in p["targets"]:
            query = t.get("expr") if t["datasource"]["type"] == PROMETHEUS else t.get("rawSql")
            assert query and query.strip(), f"{p['title']}: empty query"
            if t["datasource"]["type"] == CLICKHOUSE:
                assert t["editorType"] == "sql" and t["queryType"] in ("timeSeries", "table"), p["title"]


def test_it_covers_each_component_and_the_training_tables() -> None:
    promql = " ".join(q for _, q in queries(PROMETHEUS))
    for needle in (
        "trainguard_agent_events_total",
        "trainguard_consumer_lag",
        "trainguard_sink_lag",
        "trainguard_dead_letters_total",
        "trainguard_exporter_collections_total",
        "trainguard_exporter_collection_seconds_bucket",
        "trainguard_exporter_spool_records",
        "trainguard_actions_recoveries",
        "trainguard_actions_step_seconds_bucket",
        "trainguard_actions_holds_total",
    ):
        assert needle in promql, f"no panel shows {needle}"
    sql = " ".join(q for _, q in queries(CLICKHOUSE))
    for table in ("training_steps", "decisions", "action_events"):
        assert f"FROM {table}" in sql, f"no panel reads {table}"


def test_its_prometheus_queries_name_only_metrics_the_components_expose(tmp_path: Path) -> None:
    exposed = set().union(*component_names(tmp_path).values())
    for title, expr in queries(PROMETHEUS):
        missing = used(expr) - exposed
        assert not missing, f"panel {title!r} names metrics no component exposes: {sorted(missing)}"


def expand(sql: str) -> str:
    """The ClickHouse plugin's macros and the dashboard's variable, as Grafana would expand them
    for the last day and one job."""
    sql = re.sub(r"\$__timeFilter\((\w+)\)", r"(\1 >= toDateTime(now() - 86400) AND \1 <= now())", sql)
    sql = sql.replace("$__fromTime", "toDateTime(now() - 86400)").replace("$__toTime", "now()")
    sql = sql.replace("${training_job}", "job-1")
    assert "$" not in sql, f"an unexpanded macro or variable in {sql}"
    return sql


def incident(job: str, t0: int) -> list[Event]:
    """A job's few steps, a decision and its recovery's events, as the sink would store them."""
    steps: list[Event] = [
        TrainingStep(job=job, rank=r, step=s, ts_ms=t0 + s * 1000 + r, loss=3.0 - s / 10, step_time_s=1.0 + r)
        for s in range(3)
        for r in range(2)
    ]
    d = Decision(
        decision_id="d1",
        ts_ms=t0 + 3000,
        job=job,
        action=Action.EVICT,
        reason="xid 79",
        targets=Targets(machines=["n1"], group_kind="machine"),
    )
    phases = [
        ("recovery", ActionPhase.STARTED),
        ("evict", ActionPhase.SUCCEEDED),
        ("recovery", ActionPhase.SUCCEEDED),
    ]
    acts: list[Event] = [
        ActionEvent(
            event_id=f"e{i}",
            decision_id="d1",
            ts_ms=t0 + 4000 + i * 1000,
            job=job,
            step=step,
            phase=phase,
            action=Action.EVICT,
            duration_ms=500.0,
        )
        for i, (step, phase) in enumerate(phases)
    ]
    return [*steps, d, *acts]


# The modern engine in-process; the embedded 18.16 server runs them too in the slow suite.
@pytest.mark.parametrize("store", ["chdb", "clickhouse-18.16"], indirect=True)
def test_its_clickhouse_queries_run_against_the_schema(store: ClickHouseStore) -> None:
    store.insert_events(incident("job-1", now_ms() - 60_000))
    d = dashboard()
    sqls = [(t, expand(q)) for t, q in queries(CLICKHOUSE)]
    sqls += [(a["name"], expand(a["target"]["rawSql"])) for a in d["annotations"]["list"] if "target" in a]
    assert len(sqls) >= 7  # six panels and the decisions annotation
    for title, sql in sqls:
        try:
            rows = store.query(sql)
        except Exception as exc:
            raise AssertionError(f"{title}: {exc}\n{sql}") from exc
        assert rows, f"{title}: no row for the incident\n{sql}"
    (variable,) = [v for v in d["templating"]["list"] if v["type"] == "query"]
    assert ("job-1",) in store.query(variable["query"])
    (ettr,) = store.query(expand(dict(queries(CLICKHOUSE))["Share of minutes with steps (~ETTR)"]))
    assert 0 < ettr[0] <= 1
