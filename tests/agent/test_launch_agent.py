"""``trainguard launch --agent`` and ``trainguard agent``: the options, without starting a zygote."""

from __future__ import annotations

from click.testing import CliRunner

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


def test_the_agent_refuses_a_command_it_cannot_fork_before_starting_anything(tmp_path) -> None:
    env = {"TRAINGUARD__SIGNING__ENABLED": "false", "TRAINGUARD__STACK__HOME": str(tmp_path)}
    res = CliRunner().invoke(
        agent,
        ["--job", "llm", "--node", "n1", "--no-kafka", "--state-dir", str(tmp_path), "--", "bash", "run.sh"],
        env=env,
    )
    assert res.exit_code == 2 and "forks Python only" in res.output
    res = CliRunner().invoke(agent, ["--job", "llm", "--node", "n1", "--local-rank", "3"], env=env)
    assert res.exit_code == 2 and "give the training command" in res.output
