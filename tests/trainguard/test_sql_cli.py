"""``trainguard sql`` / ``postmortem`` / ``report`` on both engines (the same named queries)."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import replace
from pathlib import Path

from click.testing import CliRunner

from tests.infra.test_named_queries import _incident, _step_after
from trainguard.commands.postmortem import postmortem
from trainguard.commands.report import report
from trainguard.commands.sql import sql
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.config import load_settings


def _obj(store: ClickHouseStore) -> dict[str, object]:
    return {"settings": replace(load_settings(environ={}), clickhouse=store.cfg)}


def test_sql_list_and_show() -> None:
    runner = CliRunner()
    listed = runner.invoke(sql, ["list"])
    assert listed.exit_code == 0 and "mttr_by_category" in listed.output and "job=String" in listed.output
    shown = runner.invoke(sql, ["show", "ettr"])
    assert shown.exit_code == 0 and shown.output.startswith("-- name: ettr") and "argMax" in shown.output
    missing = runner.invoke(sql, ["show", "nope"])
    assert missing.exit_code == 1 and "no query named 'nope'" in missing.output


def test_sql_run_in_every_format(store: ClickHouseStore) -> None:
    store.insert_events(
        [
            *_incident(1, "m1", "gpu_unavailable", 9_000),
            *_incident(2, "m2", "nic", None),
            _step_after(1, 9_500),
        ]
    )
    runner = CliRunner()
    table = runner.invoke(sql, ["run", "incidents", "--param", "job=j"], obj=_obj(store))
    assert table.exit_code == 0, table.output
    assert "gpu_unavailable" in table.output and "(2 rows)" in table.output
    assert "2026-11-18" in table.output  # ts_ms columns shown as UTC times in a table
    js = runner.invoke(sql, ["run", "mttr_by_category", "-p", "job=j", "--format", "json"], obj=_obj(store))
    rows = [json.loads(line) for line in js.output.splitlines()]
    assert {r["fault"]: r["recovered"] for r in rows} == {"gpu_unavailable": 1, "nic": 0}
    out = runner.invoke(sql, ["run", "evictions", "-p", "job=j", "--format", "csv"], obj=_obj(store))
    parsed = list(csv.DictReader(io.StringIO(out.output)))
    assert [r["machine"] for r in parsed] == ["m1", "m2"]
    since = runner.invoke(sql, ["run", "incidents", "--since", "2026-11-18T12:00:00"], obj=_obj(store))
    assert since.exit_code == 0 and "(no rows)" in since.output  # the incidents were earlier that day


def test_sql_run_says_what_is_wrong(store: ClickHouseStore) -> None:
    runner = CliRunner()
    missing = runner.invoke(sql, ["run", "ettr"], obj=_obj(store))
    assert missing.exit_code == 1 and "needs --param job" in missing.output
    typo = runner.invoke(sql, ["run", "top_fault_machines", "-p", "limit=ten"], obj=_obj(store))
    assert typo.exit_code == 1 and "not a Int64" in typo.output
    nosince = runner.invoke(sql, ["run", "ettr", "-p", "job=j", "--since", "1h"], obj=_obj(store))
    assert nosince.exit_code == 1 and "takes no since_ms" in nosince.output


def test_postmortem_and_report_read_the_same_queries(store: ClickHouseStore, tmp_path: Path) -> None:
    store.insert_events([*_incident(1, "m1", "gpu_unavailable", 9_000), _step_after(1, 9_500)])
    runner = CliRunner()
    pm = runner.invoke(postmortem, ["--job", "j", "--json"], obj=_obj(store))
    assert pm.exit_code == 0, pm.output
    (inc,) = [json.loads(line) for line in pm.output.splitlines()]
    assert (inc["category"], inc["recovered_s"], inc["procedure_s"]) == ("gpu_unavailable", 10.5, 8.5)
    out = tmp_path / "r.html"
    rep = runner.invoke(report, ["--job", "j", "--out", str(out), "--quiet"], obj=_obj(store))
    assert rep.exit_code == 0, rep.output
    assert rep.output.strip() == str(out) and "gpu_unavailable" in out.read_text()
    none = runner.invoke(report, ["--job", "nope", "--out", str(tmp_path / "n.html")], obj=_obj(store))
    assert none.exit_code == 1 and "no training steps and no decisions" in none.output
