"""The Slurm executor's warm path on the real local Slurm (issue #37 item 2), no mocks.

A 2-node CPU gloo job (``tests/fixtures/slurm/train_gloo.py``) runs its ranks under ``trainguard
launch --agent``.  A restart decision's ``stop`` + ``restart`` go through the agents: the same
``srun`` step, and both ranks step again within seconds.  With one agent killed, the same restart
takes the cold path (a new step) and the job trains again.  Restart-to-first-step of both paths is
printed (``-s``) for the report.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

import trainguard
from tests.actions.slurm_fixture import TrainingJob, ctx, slurm_cluster, spec, start_job
from tests.net import free_port, free_port_block
from tests.waiting import wait_until
from trainguard.actions.executors.base import ExecutorEnv
from trainguard.actions.executors.slurm import SlurmExecutor
from trainguard.infra.signing import Signer, SigningConfig, init_keys
from trainguard.infra.stack.slurm import Slurm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
__all__ = ["slurm_cluster"]  # the module-scoped cluster fixture, used by name

GLOO_PY = Path(__file__).resolve().parents[1] / "fixtures" / "slurm" / "train_gloo.py"
ACTIVE = ["n1", "n2"]


def step_command(work: Path, keys: Path, agent_base: int, job: str) -> list[str]:
    """``trainguard launch --agent`` per task; node ``n<i>``'s agent on ``agent_base + 10 i``
    (every node of the local Slurm is 127.0.0.1, so their agents need ports of their own)."""
    root = str(Path(trainguard.__file__).resolve().parent.parent)
    launch = (
        f"exec {sys.executable} -m trainguard launch --job {job} --agent --no-publish "
        f"--agent-port $(({agent_base} + ${{SLURMD_NODENAME#n}} * 10)) --master-addr 127.0.0.1 "
        f"--agent-preload torch,torch.distributed --agent-state-dir {work}/agent/{{node}} "
        f"--agent-code-root {work}/code "
        f"-- {sys.executable} {GLOO_PY} {work}"
    )
    return [
        "env",
        f"PYTHONPATH={root}",
        f"TRAINGUARD__SIGNING__KEYS_DIR={keys}",
        # a Kafka nobody listens on: the agents' command listener never meets a running stack
        f"TRAINGUARD__KAFKA__BOOTSTRAP_SERVERS=127.0.0.1:{free_port()}",
        "OMP_NUM_THREADS=1",
        "bash",
        "-c",
        launch,
    ]


@pytest.fixture
def warm_job(slurm_cluster: Slurm, tmp_path: Path) -> Iterator[tuple[TrainingJob, Path]]:
    keys = tmp_path / "keys"
    init_keys(keys, ["actions"])
    base = free_port_block(70)
    work = tmp_path / "work"  # start_job makes it; the command names it before
    gen = start_job(
        slurm_cluster,
        tmp_path,
        agents=True,
        tasks_per_node=1,
        agent_ports={f"n{i}": base + 10 * i for i in range(1, 7)},
        launch_timeout_s=60.0,
    )
    job = next(gen)
    # The fixture's executor, with the launch --agent command (it needs the Slurm job's name, the
    # TrainGuard job's here) and the action service's signer.
    cfg = replace(job.executor.cfg, step_command=step_command(work, keys, base, job.name))
    signer = Signer.load(SigningConfig(keys_dir=str(keys)), tmp_path, "actions")
    job.executor = SlurmExecutor(cfg, ExecutorEnv(state_dir=job.state_dir, signer=signer))
    try:
        yield job, work
    finally:
        for n in ACTIVE:  # the ranks run in sessions of their own: end what outlived its agent
            for pid in _rank_pids(work, n):
                _kill(pid)
        next(gen, None)


def _state(work: Path, node: str) -> dict:
    try:
        return dict(json.loads((work / "agent" / node / "state.json").read_text()))
    except (OSError, ValueError):
        return {}


def _rank_pids(work: Path, node: str) -> list[int]:
    return [r["pid"] for r in _state(work, node).get("ranks", []) if r.get("pid")]


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def first_step(work: Path, node: str, generation: int) -> float | None:
    """When ``node``'s rank first stepped in ``generation`` (unix time), None before."""
    path = work / f"progress-{node}.log"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 6 and parts[4] == str(generation):
            return float(parts[0])
    return None


def both_stepped(work: Path, generation: int, timeout_s: float) -> float:
    """The later of the two ranks' first step in ``generation``."""

    def found() -> float | None:
        times = [first_step(work, n, generation) for n in ACTIVE]
        return max(times) if all(t is not None for t in times) else None  # type: ignore[type-var]

    return wait_until(found, timeout_s, lambda: f"both ranks stepping in generation {generation}")


def test_a_restart_goes_warm_through_the_agents_and_cold_when_one_is_killed(
    warm_job: tuple[TrainingJob, Path],
) -> None:
    job, work = warm_job
    ex = job.executor
    s = spec(job.name, ACTIVE, [])

    # The first launch is cold (no agents yet): a step of launch --agent tasks.
    ex.restart(s, ctx("restart", seconds=90))
    assert ex.warm.last["path"] == "cold" and "no training step" in ex.warm.last["why"]
    wait_until(lambda: all(_state(work, n).get("state") == "running" for n in ACTIVE), 400, "agents running")
    gen = _state(work, "n1")["generation"]
    both_stepped(work, gen, 90)
    steps = sorted(i for i, _, _ in job.training_steps())
    assert len(steps) == 1

    # A restart decision (stop, restart): the warm path, in the same step.
    t0 = time.time()
    ex.stop(s, ctx("stop", seconds=60))
    ex.restart(s, ctx("restart", seconds=60))
    assert ex.warm.last["path"] == "warm", ex.warm.last
    warm_gen = ex.warm.last["generation"]
    assert warm_gen == gen + 2  # the stop's world of no machines, then the restart's
    warm_s = both_stepped(work, warm_gen, 30) - t0
    assert sorted(i for i, _, _ in job.training_steps()) == steps  # no new srun step
    assert warm_s < 10, f"warm restart to first step took {warm_s:.2f} s"
    assert any(c.argv == ["trainguard-agents", "restart"] and c.rc == 0 for c in ex.commands)

    # One agent killed: the same restart takes the cold path and the job trains again.
    os.kill(_state(work, "n2")["pid"], signal.SIGKILL)
    for pid in _rank_pids(work, "n2"):
        _kill(pid)
    t1 = time.time()
    ex.stop(s, ctx("stop", seconds=60))
    ex.restart(s, ctx("restart", seconds=90))
    assert ex.warm.last["path"] == "cold", ex.warm.last
    new_steps = sorted(i for i, _, _ in job.training_steps())
    assert len(new_steps) == 1 and new_steps != steps  # a new srun step
    cold_gen = wait_until(
        lambda: _state(work, "n1").get("generation", 0) > warm_gen or None, 90, "new agents"
    )
    assert cold_gen
    cold_gen = _state(work, "n1")["generation"]
    cold_s = both_stepped(work, cold_gen, 180) - t1
    print(f"\nrestart to both ranks' first step: warm {warm_s:.2f} s, cold {cold_s:.2f} s")
    assert cold_s > warm_s


def start_standby_agent(job: TrainingJob, work: Path, node: str, port: int) -> subprocess.Popen[bytes]:
    """``trainguard agent`` with no world on ``node``, as a step of the job the executor's ``stop``
    and ``restart`` leave alone (``keep_steps``): warm, no ranks, waiting to be named."""
    env_argv = job.executor.cfg.step_command[: job.executor.cfg.step_command.index("bash")]
    agent = [
        sys.executable, "-m", "trainguard", "agent", "--job", job.name, "--node", node, "--no-kafka",
        "--port", str(port), "--preload", "torch,torch.distributed", "--state-dir", f"{work}/agent/{node}",
        "--", sys.executable, str(GLOO_PY), str(work),
    ]  # fmt: skip
    argv = [
        "srun", f"--jobid={job.job_id}", "--job-name=tg-agent", "--overlap", "--nodes=1", "--ntasks=1",
        f"--nodelist={node}", *env_argv, *agent,
    ]  # fmt: skip
    log = (work / f"standby-{node}.log").open("wb")
    return subprocess.Popen(
        argv, env=job.executor.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def test_a_standby_agent_joins_in_the_evicted_nodes_place_warm(warm_job: tuple[TrainingJob, Path]) -> None:
    job, work = warm_job
    ex = job.executor
    ex.cfg = replace(ex.cfg, keep_steps=["tg-exporter", "tg-agent"])
    ex.restart(spec(job.name, ACTIVE, ["n3"]), ctx("restart", seconds=90))
    standby = start_standby_agent(job, work, "n3", ex.cfg.agent_ports["n3"])
    try:
        wait_until(
            lambda: all(_state(work, n).get("state") == "running" for n in ACTIVE), 400, "agents running"
        )
        wait_until(lambda: _state(work, "n3").get("state") == "warm", 400, "the standby's agent warm")
        both_stepped(work, _state(work, "n1")["generation"], 90)
        steps = sorted(i for i, _, _ in job.training_steps())

        # n2 evicted: the plan's stop, evict, restart with n3 in n2's place -- all warm.
        t0 = time.time()
        ex.stop(spec(job.name, ACTIVE, ["n3"]), ctx("stop", seconds=60))
        ex.evict(spec(job.name, ACTIVE, ["n3"]), ["n2"], ctx("evict", category="xid"))
        ex.restart(spec(job.name, ["n1", "n3"], []), ctx("restart", seconds=60))
        assert ex.warm.last["path"] == "warm", ex.warm.last
        gen = ex.warm.last["generation"]
        line = wait_until(
            lambda: next((p for p in _progress(work, "n3") if p[4] == str(gen)), None), 30, "n3 stepping"
        )
        assert line[2] == "1"  # n2's rank, on the standby
        print(f"\nstandby join to its first step: {float(line[0]) - t0:.2f} s")
        assert _state(work, "n2")["state"] == "warm" and not _state(work, "n2")["ranks"]
        assert sorted(i for i, _, _ in job.training_steps()) == steps  # no new training step
    finally:
        for pid in _rank_pids(work, "n3"):
            _kill(pid)
        _kill(standby.pid)
        standby.wait(30)


def _progress(work: Path, node: str) -> list[list[str]]:
    path = work / f"progress-{node}.log"
    return [ln.split() for ln in path.read_text().splitlines()] if path.exists() else []


def test_a_hot_update_goes_to_the_agents_and_the_restart_runs_the_new_version_warm(
    warm_job: tuple[TrainingJob, Path],
) -> None:
    job, work = warm_job
    ex = job.executor
    (work / "code" / "v2").mkdir(parents=True)  # version v2's directory (the script is absolute)
    s = spec(job.name, ACTIVE, [])
    ex.restart(s, ctx("restart", seconds=90))
    wait_until(lambda: all(_state(work, n).get("state") == "running" for n in ACTIVE), 400, "agents running")
    both_stepped(work, _state(work, "n1")["generation"], 90)
    steps = sorted(i for i, _, _ in job.training_steps())

    # The plan of a code update: hot_update (the agents pre-warm v2: lazy), then stop + restart,
    # which carries v2 (urgent) -- in place.
    ex.hot_update(s, "v2", ctx("hot_update", seconds=60))
    assert any(c.argv == ["trainguard-agents", "code"] and c.rc == 0 for c in ex.commands)
    wait_until(
        lambda: all(_state(work, n).get("pending_code_version") == "v2" for n in ACTIVE), 30, "v2 pending"
    )
    ex.stop(s, ctx("stop", seconds=60))
    ex.restart(s, ctx("restart", seconds=120))
    assert ex.warm.last["path"] == "warm", ex.warm.last
    gen = ex.warm.last["generation"]
    both_stepped(work, gen, 60)
    versions = {p[5] for n in ACTIVE for p in _progress(work, n) if p[4] == str(gen)}
    assert versions == {"v2"}
    assert all(_state(work, n)["code_version"] == "v2" for n in ACTIVE)
    assert sorted(i for i, _, _ in job.training_steps()) == steps
