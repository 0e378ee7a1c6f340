"""The chaos suite (``bench/chaos.py``) at its small size, one test per scenario.

One run of ``bench/chaos.py --small --json`` with eight of the scenarios, in a subprocess, serves
the module: the script starts a private stack of its own (temporary home, free ports, signing
on), runs the scenarios one after another on it (stopping each one's processes before the next,
as a full bench run does) and stops it before it exits, so these tests never touch the shared
stack the other integration tests use.  Two private stacks in all (``hostile_tenant`` runs on
its own) instead of one per scenario.
Each test asserts its scenario passed and the counts behind that verdict.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

#: One run's bound: eight small scenarios and one stack up and down (it was nine runs of at most
#: 540 s each, each with a stack of its own).
RUN_TIMEOUT_S = 2400
pytestmark = [pytest.mark.slow, pytest.mark.timeout(RUN_TIMEOUT_S + 300)]
#: ``chaos(name)`` in a test: that scenario's result.
Result = Callable[[str], dict[str, Any]]
CHAOS = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"
#: The scenarios that share one private stack, in the script's order.
SHARED = (
    "broker_kill",
    "clickhouse_outage",
    "worker_kill",
    "actions_kill",
    "fuzz_flood",
    "forged_control",
    "evict_storm",
    "name_injection",
)
#: On a stack of their own, as before: hostile_tenant stops the broker and brings it back with
#: `stack up`.  It has not been seen passing after the other eight on one stack (on a two-core host
#: at load 15-60 its broker missed `stack up`'s 90 s there and alone alike), so it is not shared.
OWN_STACK = ("hostile_tenant",)


def run_chaos(scenarios: tuple[str, ...], timeout_s: float) -> tuple[dict[str, dict[str, Any]], str]:
    """Each scenario's JSON result by name, and the script's stderr; the script is stopped (SIGTERM:
    it takes its stack down) if it outlives ``timeout_s`` or the test is interrupted."""
    argv = [sys.executable, str(CHAOS), "--small", "--json"]
    for name in scenarios:
        argv += ["--scenario", name]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    doc = json.loads(out)  # exactly one JSON object on stdout
    assert list(doc) == ["scenarios"], out
    results = {res["name"]: res for res in doc["scenarios"]}
    assert sorted(results) == sorted(scenarios), out
    # The exit status agrees with the results: 0 exactly when every scenario passed.
    assert proc.returncode == (0 if all(r["passed"] for r in results.values()) else 1), err[-4000:]
    return results, err


Run = tuple[dict[str, dict[str, Any]], str]


@pytest.fixture(scope="module")
def chaos_runs() -> Callable[[tuple[str, ...]], Run]:
    """``run(group)``: one run of the script for a group of scenarios, made once per module."""
    done: dict[tuple[str, ...], Run] = {}

    def run(group: tuple[str, ...]) -> Run:
        if group not in done:
            done[group] = run_chaos(group, RUN_TIMEOUT_S)
        return done[group]

    return run


@pytest.fixture
def chaos(chaos_runs: Callable[[tuple[str, ...]], Run]) -> Result:
    """``chaos(name)``: that scenario's result, asserted passed with every key of the verdict."""

    def result(scenario: str) -> dict[str, Any]:
        results, err = chaos_runs((scenario,) if scenario in OWN_STACK else SHARED)
        res = results[scenario]
        for key in ("passed", "produced", "stored", "lost", "duplicated", "accepted_forged", "notes"):
            assert key in res, key
        assert res["passed"], f"{res['notes']}\n{err[-4000:]}"
        return dict(res)

    return result


def test_broker_kill_loses_no_sample(chaos: Result) -> None:
    res = chaos("broker_kill")
    assert res["produced"] > 0 and res["stored"] == res["produced"]
    assert res["lost"] == 0 and res["duplicated"] == 0
    assert res["lines_stored"] == res["lines_written"] > 0


def test_clickhouse_outage_loses_no_row_and_decisions_keep_flowing(chaos: Result) -> None:
    res = chaos("clickhouse_outage")
    assert res["lost"] == 0 and res["duplicated"] == 0 and res["stored"] == res["produced"] > 0
    assert res["outage_probes"] > 0
    assert res["outage_decided"] == res["outage_detected"] == res["outage_probes"]
    assert res["decisions_made"] == res["decisions_expected"] == res["decisions_stored"]


def test_worker_kill_loses_no_decision_and_absorbs_duplicates(chaos: Result) -> None:
    res = chaos("worker_kill")
    n = res["decisions_expected"]
    assert n > 0 and res["lost"] == 0 and res["duplicated"] == 0
    assert res["decisions_made"] == res["decisions_acted"] == res["stored"] == n


def test_actions_kill_completes_each_recovery_once(chaos: Result) -> None:
    res = chaos("actions_kill")
    assert res["decisions_acted"] == res["decisions_expected"] > 0
    assert res["lost"] == 0 and res["duplicated"] == 0


def test_fuzz_flood_is_all_dead_lettered_and_the_pipeline_still_acts(chaos: Result) -> None:
    res = chaos("fuzz_flood")
    assert res["produced"] >= 500 and res["stored"] == res["produced"] and res["lost"] == 0
    assert res["not_dead_lettered_by_kind"] == {}
    assert res["decisions_acted"] == 1


def test_forged_control_records_are_never_accepted(chaos: Result) -> None:
    res = chaos("forged_control")
    assert res["produced"] >= 100 and res["accepted_forged"] == 0
    assert res["dead_lettered_at_auth"] == res["produced"]
    assert res["decisions_acted"] == 1  # the one authentic decision


def test_evict_storm_is_capped_and_the_rest_held(chaos: Result) -> None:
    res = chaos("evict_storm")
    assert res["decisions_made"] == res["decisions_expected"] > res["evicted"]
    assert res["evicted"] == res["eviction_cap"] and res["held"] >= 1
    assert res["lost"] == 0


def test_a_hostile_tenant_touches_nothing_outside_fr_and_the_xid_gets_through(chaos: Result) -> None:
    res = chaos("hostile_tenant")
    assert res["victim_files"] > 0 and res["victim_files_touched"] == 0
    assert res["bombs_refused"] == 2 and res["valid_dump_entries"] > 0 and res["hard_link_refused"]
    assert res["links_removed"] == 2 and res["quarantine_is_real_dir"]
    assert res["exporter_alive"] and res["heartbeats_after"] > 0
    assert res["spool_dropped"] > 0  # the flood did fill the spool ...
    assert res["stored"] == res["produced"] == 1 and res["lost"] == 0  # ... and the Xid got through
    assert res["forged_kernel_lines"] > 0 and res["accepted_forged"] == 0


def test_injected_names_are_dead_lettered_and_touch_nothing(chaos: Result) -> None:
    res = chaos("name_injection")
    assert res["produced"] > 0 and res["stored"] == res["produced"] and res["lost"] == 0
    assert res["accepted_forged"] == 0 and res["files_with_injected_names"] == 0
    assert res["decisions_acted"] == 1  # the genuine decision afterwards
    assert res["slurm_paths_refused"] == res["slurm_names_tried"] > 0
    assert res["k8s_old_label_collisions"] > 0 and res["k8s_label_collisions"] == 0
