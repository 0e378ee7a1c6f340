"""bench/demo_phases.py on the summary of a real demo run (96.0% ETTR, 12/12 recovered)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.demo_phases import collect, medians

SUMMARY = Path(__file__).resolve().parents[1] / "fixtures" / "demo" / "summary-96pct.json"


def test_one_run_gives_its_own_phases() -> None:
    summary = json.loads(SUMMARY.read_text())
    faults, steps, values = collect([summary])
    assert faults[:4] == ["xid", "user-error", "nan", "crash"] and len(faults) == 12
    # steps in the order a recovery runs them; replenish (after the restart) last
    assert steps.index("stop") < steps.index("restart") < steps.index("replenish")
    table = medians(values)
    assert table["xid"]["detect"] == 0.99 and table["xid"]["recovered"] == 3.17
    assert table["xid"]["step:replenish"] == 1.8
    assert set(table["nic-flap"]) == {"detect"}  # tolerated: nothing stopped, nothing restarted
    assert table["nan"]["step:diagnose"] == 0.65


def test_the_median_is_taken_per_fault_over_runs() -> None:
    summary = json.loads(SUMMARY.read_text())
    slower = json.loads(SUMMARY.read_text())
    for inc in slower["incidents"]:
        if inc["phases"].get("detect") is not None:
            inc["phases"]["detect"] += 10
    missing = {"incidents": [i for i in summary["incidents"] if i["fault"] != "xid"]}
    _, _, values = collect([summary, slower, missing])
    table = medians(values)
    assert table["xid"]["detect"] == (0.99 + 10.99) / 2  # two runs had it
    assert table["crash"]["detect"] == 0.39  # the middle of 0.39, 0.39, 10.39


def test_a_loader_taken_over_in_place_has_a_takeover_and_no_recovery_steps() -> None:
    """A real run's three hung loaders, each taken over by its rank's shadow loader (at b4c4231)."""
    summary = json.loads((SUMMARY.parent / "summary-shadow-loader.json").read_text())
    faults, steps, values = collect([summary])
    assert faults == ["hang-dataloader"] and steps == []
    row = medians(values)["hang-dataloader"]
    assert set(row) == {"detect", "takeover", "first_step", "recovered"}
    assert (row["takeover"], row["recovered"]) == (1.51, 1.65)
