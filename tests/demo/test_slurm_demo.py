"""``trainguard demo --cluster slurm`` end to end: the demo job as a batch job on the stack's real
private Slurm, faults injected, recovery through the action service's slurm executor (no mocks:
real Kafka, ClickHouse, Slurm daemons, PyTorch ranks).  Two faults keep it to a few minutes: an
Xid (the node is drained with the decision in its reason, a spare takes its ranks) and a crash."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.demo.helpers import run_demo
from trainguard.infra.config import Settings
from trainguard.infra.stack.slurm import Slurm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_demo_under_slurm_drains_the_xid_node_and_recovers_both_faults(
    stack_settings: Settings, tmp_path: Path
) -> None:
    summary, res = run_demo("slurm", tmp_path)
    # The timeline's node table and Slurm agree: n1 drained by the Xid's decision, named in the reason.
    nodes = {n["node"]: n for n in summary["slurm"]["nodes"]}
    assert nodes["n1"]["state"].startswith("drain") and nodes["n1"]["reason"].startswith("trainguard "), nodes
    slurm = Slurm(stack_settings.stack)
    shown = {n["name"]: n for n in slurm.nodes()}
    assert shown["n1"]["state"].startswith("drain") and shown["n1"]["reason"] == nodes["n1"]["reason"]
    assert "Slurm job" in res.stdout and "n1" in res.stdout
