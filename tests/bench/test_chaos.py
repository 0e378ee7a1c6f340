"""The chaos suite (``bench/chaos.py``) at its small size, one scenario per test.

Each test runs ``bench/chaos.py --scenario NAME --small --json`` in a subprocess: the script starts
a private stack of its own (temporary home, free ports, signing on) and stops it before it exits,
so these tests never touch the shared stack the other integration tests use.  Each asserts the
scenario passed and the counts behind that verdict.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow
CHAOS = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"


def run_chaos(scenario: str, timeout_s: float) -> dict[str, Any]:
    """The scenario's JSON result; the script is stopped (SIGTERM: it takes its stack down) if it
    outlives ``timeout_s`` or the test is interrupted."""
    proc = subprocess.Popen(
        [sys.executable, str(CHAOS), "--scenario", scenario, "--small", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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
    (res,) = doc["scenarios"]
    assert res["name"] == scenario
    for key in ("passed", "produced", "stored", "lost", "duplicated", "accepted_forged", "notes"):
        assert key in res, key
    assert res["passed"], f"{res['notes']}\n{err[-4000:]}"
    assert proc.returncode == 0, err[-4000:]
    return dict(res)


@pytest.mark.timeout(600)
def test_broker_kill_loses_no_sample() -> None:
    res = run_chaos("broker_kill", 540)
    assert res["produced"] > 0 and res["stored"] == res["produced"]
    assert res["lost"] == 0 and res["duplicated"] == 0
    assert res["lines_stored"] == res["lines_written"] > 0


@pytest.mark.timeout(600)
def test_clickhouse_outage_loses_no_row_and_decisions_keep_flowing() -> None:
    res = run_chaos("clickhouse_outage", 540)
    assert res["lost"] == 0 and res["duplicated"] == 0 and res["stored"] == res["produced"] > 0
    assert res["outage_probes"] > 0
    assert res["outage_decided"] == res["outage_detected"] == res["outage_probes"]
    assert res["decisions_made"] == res["decisions_expected"] == res["decisions_stored"]


@pytest.mark.timeout(600)
def test_worker_kill_loses_no_decision_and_absorbs_duplicates() -> None:
    res = run_chaos("worker_kill", 540)
    n = res["decisions_expected"]
    assert n > 0 and res["lost"] == 0 and res["duplicated"] == 0
    assert res["decisions_made"] == res["decisions_acted"] == res["stored"] == n


@pytest.mark.timeout(600)
def test_actions_kill_completes_each_recovery_once() -> None:
    res = run_chaos("actions_kill", 540)
    assert res["decisions_acted"] == res["decisions_expected"] > 0
    assert res["lost"] == 0 and res["duplicated"] == 0


@pytest.mark.timeout(600)
def test_fuzz_flood_is_all_dead_lettered_and_the_pipeline_still_acts() -> None:
    res = run_chaos("fuzz_flood", 540)
    assert res["produced"] >= 500 and res["stored"] == res["produced"] and res["lost"] == 0
    assert res["not_dead_lettered_by_kind"] == {}
    assert res["decisions_acted"] == 1


@pytest.mark.timeout(600)
def test_forged_control_records_are_never_accepted() -> None:
    res = run_chaos("forged_control", 540)
    assert res["produced"] >= 100 and res["accepted_forged"] == 0
    assert res["dead_lettered_at_auth"] == res["produced"]
    assert res["decisions_acted"] == 1  # the one authentic decision


@pytest.mark.timeout(600)
def test_evict_storm_is_capped_and_the_rest_held() -> None:
    res = run_chaos("evict_storm", 540)
    assert res["decisions_made"] == res["decisions_expected"] > res["evicted"]
    assert res["evicted"] == res["eviction_cap"] and res["held"] >= 1
    assert res["lost"] == 0


@pytest.mark.timeout(600)
def test_a_hostile_tenant_touches_nothing_outside_fr_and_the_xid_gets_through() -> None:
    res = run_chaos("hostile_tenant", 540)
    assert res["victim_files"] > 0 and res["victim_files_touched"] == 0
    assert res["bombs_refused"] == 2 and res["valid_dump_entries"] > 0 and res["hard_link_refused"]
    assert res["links_removed"] == 2 and res["quarantine_is_real_dir"]
    assert res["exporter_alive"] and res["heartbeats_after"] > 0
    assert res["spool_dropped"] > 0  # the flood did fill the spool ...
    assert res["stored"] == res["produced"] == 1 and res["lost"] == 0  # ... and the Xid got through
    assert res["forged_kernel_lines"] > 0 and res["accepted_forged"] == 0


@pytest.mark.timeout(600)
def test_injected_names_are_dead_lettered_and_touch_nothing() -> None:
    res = run_chaos("name_injection", 540)
    assert res["produced"] > 0 and res["stored"] == res["produced"] and res["lost"] == 0
    assert res["accepted_forged"] == 0 and res["files_with_injected_names"] == 0
    assert res["decisions_acted"] == 1  # the genuine decision afterwards
    assert res["slurm_paths_refused"] == res["slurm_names_tried"] > 0
    assert res["k8s_old_label_collisions"] > 0 and res["k8s_label_collisions"] == 0
