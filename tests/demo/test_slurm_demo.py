"""``trainguard demo --cluster slurm`` end to end: the demo job as a batch job on the stack's real
private Slurm, faults injected, recovery through the action service's slurm executor (no mocks:
real Kafka, ClickHouse, Slurm daemons, PyTorch ranks).  Two faults keep it to a few minutes: an
Xid (the node is drained with the decision in its reason, a spare takes its ranks) and a crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra.config import Settings
from infra.stack.slurm import Slurm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_demo_under_slurm_drains_the_xid_node_and_recovers_both_faults(
    stack_settings: Settings, tmp_path: Path
) -> None:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(
        yaml.safe_dump(
            [
                {"fault": "xid", "machine": 0, "after_s": 15},
                {"fault": "crash", "machine": 1, "after_s": 15},
            ]
        )
    )
    summary_file = tmp_path / "summary.json"
    trainguard = str(Path(sys.executable).with_name("trainguard"))
    res = subprocess.run(
        [
            trainguard,
            "demo",
            "--cluster",
            "slurm",
            "--scenario",
            str(scenario),
            "--summary-json",
            str(summary_file),
        ],
        capture_output=True,
        text=True,
        timeout=840,
        env=os.environ.copy(),
    )
    out = res.stdout[-6000:] + res.stderr[-3000:]
    assert res.returncode == 0, out
    summary = json.loads(summary_file.read_text())
    assert [i["fault"] for i in summary["incidents"]] == ["xid", "crash"], out
    assert all(i["recovered"] for i in summary["incidents"]), out
    xid = summary["incidents"][0]
    assert xid["machine"] == "n1" and xid["action"] == "evict", out
    # The timeline's node table and Slurm agree: n1 drained by the Xid's decision, named in the reason.
    nodes = {n["node"]: n for n in summary["slurm"]["nodes"]}
    assert nodes["n1"]["state"].startswith("drain") and nodes["n1"]["reason"].startswith("trainguard "), nodes
    slurm = Slurm(stack_settings.stack)
    shown = {n["name"]: n for n in slurm.nodes()}
    assert shown["n1"]["state"].startswith("drain") and shown["n1"]["reason"] == nodes["n1"]["reason"]
    assert "Slurm job" in res.stdout and "n1" in res.stdout
