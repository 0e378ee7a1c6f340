"""The private Slurm cluster of ``stack up --slurm``: real munged, slurmctld and slurmd, no mocks.

The cluster runs in a temporary stack home on free ports, so it never meets a system Slurm or the
running embedded stack.  Missing Slurm binaries fail these tests with the setup hint (CI installs
them with scripts/setup.sh); they are not skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.net import free_port_block, free_ports
from tests.waiting import wait_until
from trainguard.cli import main
from trainguard.infra.config import load_settings
from trainguard.infra.proctable import LIVE
from trainguard.infra.stack.procs import StackError
from trainguard.infra.stack.slurm import Slurm, SlurmConfig, _binary

pytestmark = pytest.mark.slow


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    # Kafka/ClickHouse ports nobody listens on: `stack status`/`down` of this home must not reach
    # the running embedded stack.
    kafka, controller, http, tcp, ctld = free_ports(5)
    base = free_port_block(4)
    return {
        "TRAINGUARD_HOME": str(tmp_path),
        "TRAINGUARD__STACK__KAFKA_PORT": str(kafka),
        "TRAINGUARD__STACK__KAFKA_CONTROLLER_PORT": str(controller),
        "TRAINGUARD__STACK__CLICKHOUSE_HTTP_PORT": str(http),
        "TRAINGUARD__STACK__CLICKHOUSE_TCP_PORT": str(tcp),
        "TRAINGUARD__STACK__SLURM_CTLD_PORT": str(ctld),
        "TRAINGUARD__STACK__SLURM_FIRST_NODE_PORT": str(base),
    }


@pytest.fixture
def slurm(env: dict[str, str]) -> Iterator[Slurm]:
    cluster = Slurm(load_settings(environ=env).stack, nodes=4)
    try:
        started = cluster.start()
        assert started == ["munged", "slurmctld", "slurmd n1", "slurmd n2", "slurmd n3", "slurmd n4"]
        cluster.wait_idle(60)
        yield cluster
    finally:
        cluster.stop()


def _states(cluster: Slurm) -> dict[str, str]:
    return {n["name"]: n["state"] for n in cluster.nodes()}


@pytest.mark.timeout(240)
def test_four_nodes_run_jobs_drain_resume_status_and_down(slurm: Slurm, env: dict[str, str]) -> None:
    assert _states(slurm) == {f"n{i}": "idle" for i in range(1, 5)}

    # One task per node, each on its own slurmd.
    res = slurm.run("srun", "-N", "4", "-n", "4", "bash", "-c", "echo $SLURMD_NODENAME", timeout_s=60)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.split()) == ["n1", "n2", "n3", "n4"]

    # Drain n3: sinfo and scontrol agree, and the next job avoids it.
    res = slurm.run("scontrol", "update", "NodeName=n3", "State=DRAIN", 'Reason="trainguard test"')
    assert res.returncode == 0, res.stderr
    n3 = next(n for n in slurm.nodes() if n["name"] == "n3")
    assert n3["state"] == "drained" and n3["reason"] == "trainguard test"
    shown = slurm.run("scontrol", "-o", "show", "node", "n3").stdout
    assert "State=IDLE+DRAIN" in shown and "Reason=trainguard test" in shown
    res = slurm.run("srun", "-N", "3", "-n", "3", "bash", "-c", "echo $SLURMD_NODENAME", timeout_s=60)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.split()) == ["n1", "n2", "n4"]

    # RESUME brings it back.
    res = slurm.run("scontrol", "update", "NodeName=n3", "State=RESUME")
    assert res.returncode == 0, res.stderr
    wait_until(lambda: _states(slurm)["n3"] == "idle", 30, lambda: f"n3 idle again ({_states(slurm)})")

    # `stack status --json` shows the Slurm part (Kafka/ClickHouse of this home are not running).
    out = CliRunner().invoke(main, ["stack", "status", "--json"], env=env)
    st = json.loads(out.output)
    assert st["slurm"]["running"] and st["slurm"]["healthy"]
    assert [(n["name"], n["state"]) for n in st["slurm"]["nodes"]] == [(f"n{i}", "idle") for i in range(1, 5)]
    pids = st["slurm"]["pids"]
    assert pids["munged"] and pids["slurmctld"] and sorted(pids["slurmd"]) == ["n1", "n2", "n3", "n4"]
    # A system munge's socket is not ours.
    assert st["slurm"]["munge_socket"].startswith(env["TRAINGUARD_HOME"])

    # `stack down` stops every daemon of this home.
    out = CliRunner().invoke(main, ["stack", "down"], env=env)
    assert out.exit_code == 0, out.output
    assert "slurmctld" in out.output and "munged" in out.output and "slurmd n4" in out.output
    all_pids = [pids["munged"], pids["slurmctld"], *pids["slurmd"].values()]
    assert not slurm.running()
    st = json.loads(CliRunner().invoke(main, ["stack", "status", "--json"], env=env).output)
    assert not st["slurm"]["running"] and st["slurm"]["pids"]["slurmd"] == {}
    assert not any(LIVE.alive(pid) for pid in all_pids)


def test_missing_binary_is_a_clear_message() -> None:
    with pytest.raises(StackError, match=r"not installed: run scripts/setup\.sh"):
        _binary("slurmd-that-is-not-there")


def test_config_rejects_overlapping_ports() -> None:
    with pytest.raises(ValueError, match="lies in the node ports"):
        SlurmConfig(nodes=4, ctld_port=17002, first_node_port=17001)
