"""The placement bench on a small cluster: the planner keeps groups in fewer pods than first-free,
and ``--json`` prints exactly the documented keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.placement_bench import parse_args, run

ROOT = Path(__file__).resolve().parent.parent.parent
SMALL = [
    "--pods", "4", "--racks", "2", "--spares-per-rack", "3", "--tp", "2", "--pp", "4", "--dp", "8",
    "--gpus-per-machine", "2", "--standbys", "4", "--recoveries", "40", "--repair-after", "5",
]  # fmt: skip


def test_the_planner_keeps_groups_in_fewer_pods_than_first_free() -> None:
    lines: list[str] = []
    out = run(parse_args(SMALL), log=lines.append)
    ff, planner = out["first_free"], out["planner"]
    # One standby per pod and spares in every rack: every DP group stays in its pod.  (First-free
    # fills every group with pod 0's machines, which even narrows a pipeline now and then.)
    assert planner["max_dp_spread"] == 1 < ff["max_dp_spread"]
    assert planner["objective"] < ff["objective"]
    assert planner["max_pp_spread"] <= 4
    assert 0 < out["ms_per_decision"] < 1000
    assert lines[0].startswith("placement bench: 32 machines (64 GPUs), 4 pods x 2 racks, TP2 PP4 DP8")
    assert run(parse_args(SMALL), log=lambda _: None)["planner"] == planner  # seeded: same run


def test_json_prints_exactly_the_documented_keys() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "placement_bench.py"), *SMALL, "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    out = json.loads(done.stdout)
    assert list(out) == ["first_free", "planner", "ms_per_decision"]
    for policy in ("first_free", "planner"):
        assert list(out[policy]) == ["max_dp_spread", "max_pp_spread"]
        assert all(isinstance(v, int) for v in out[policy].values())
    assert isinstance(out["ms_per_decision"], float)
