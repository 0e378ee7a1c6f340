"""``trainguard launch --agent`` and ``trainguard agent``: the options, and the command end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

import trainguard
from tests.agent.harness import make_keys
from tests.waiting import wait_until
from trainguard.agent import client
from trainguard.commands.agent import agent
from trainguard.commands.launch import agent_options
from trainguard.launch_env import LaunchConfig, plan_launch

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURMD_NODENAME": "gpu-02",
    "SLURM_STEP_NODELIST": "gpu-[01-02]",
    "SLURM_JOB_NODELIST": "gpu-[01-03]",
}


def test_a_launch_task_agent_holds_its_rank_of_the_slurm_world() -> None:
    cfg = LaunchConfig(
        job="llm", agent=True, agent_preload=["torch"], agent_state_dir="/tmp/a/{job_id}/{local_rank}"
    )
    plan = plan_launch(cfg, {**SLURM, "TRAINGUARD_RESTART": "2"})
    opts = agent_options(plan, cfg, ["python", "train.py"])
    assert (opts["node"], opts["local_ranks"], opts["ranks_per_node"]) == ("gpu-02", [1], 2)
    assert (opts["nodes"], opts["generation"], opts["master_port"]) == (["gpu-01", "gpu-02"], 2, 24242)
    # one agent per task: the local rank's own port and state directory
    assert (opts["port"], opts["state_dir"], opts["preload"]) == (9404, "/tmp/a/4242/1", ["torch"])


def test_the_agent_refuses_a_command_it_cannot_fork_before_starting_anything(tmp_path: Path) -> None:
    env = {"TRAINGUARD__SIGNING__ENABLED": "false", "TRAINGUARD__STACK__HOME": str(tmp_path)}
    res = CliRunner().invoke(
        agent,
        ["--job", "llm", "--node", "n1", "--no-kafka", "--state-dir", str(tmp_path), "--", "bash", "run.sh"],
        env=env,
    )
    assert res.exit_code == 2 and "forks Python only" in res.output
    res = CliRunner().invoke(agent, ["--job", "llm", "--node", "n1", "--local-rank", "3"], env=env)
    assert res.exit_code == 2 and "give the training command" in res.output


RANK = """import os, time
open(os.path.join(os.environ["OUT"], "gen" + os.environ["TRAINGUARD_GENERATION"]), "w").write(os.environ["RANK"])
time.sleep(600)
"""


def test_trainguard_agent_serves_until_sigterm_and_leaves_gone(tmp_path: Path) -> None:
    """The command end to end (a process of its own, signing on, no Kafka, a rank without torch)."""
    keys = make_keys(tmp_path)
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "out").mkdir()
    state = tmp_path / "agent" / "state.json"
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(trainguard.__file__).resolve().parent.parent),
        "TRAINGUARD__SIGNING__KEYS_DIR": str(tmp_path / "keys"),
        "OUT": str(tmp_path / "out"),
    }
    argv = ["--job", "llm", "--node", "n2", "--nodes", "n1,n2", "--master-addr", "n1", "--generation", "1"]
    argv += ["--no-kafka", "--host", "127.0.0.1", "--port", "0", "--state-dir", str(tmp_path / "agent")]
    argv += ["--", "python", str(tmp_path / "rank.py")]
    run = "from trainguard.commands.agent import agent; agent.main()"
    proc = subprocess.Popen([sys.executable, "-c", run, *argv], env=env)
    try:
        doc = wait_until(lambda: _running(state), 60, "the agent running generation 1")
        assert (tmp_path / "out" / "gen1").read_text() == "1" and doc["nodes"] == ["n1", "n2"]
        url = f"http://127.0.0.1:{doc['port']}"
        status, reply = client.send(
            url, client.restart_command("llm", "n2", 2, ["n2"], "n2", 29600), keys.signer
        )
        assert status == 200 and reply["outcome"] == "done", reply
        wait_until(lambda: (tmp_path / "out" / "gen2").exists(), 30, "generation 2's rank")
        assert (tmp_path / "out" / "gen2").read_text() == "0"  # alone in the new world: rank 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert json.loads(state.read_text())["state"] == "gone"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _running(state: Path) -> dict | None:
    try:
        doc = json.loads(state.read_text())
    except (OSError, ValueError):
        return None
    return doc if doc["state"] == "running" else None
