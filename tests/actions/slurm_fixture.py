"""A real private Slurm for the Slurm executor tests, and a training job on it (no mocks).

The cluster (munged, slurmctld, six slurmd ``n1``..``n6``) runs in a temporary stack home on free
ports, as in ``tests/infra/test_slurm_stack.py``, so it never meets a system Slurm or the running
embedded stack.  Each test gets its own allocation ``sbatch -N 4 -w n[1-4]`` (3 active nodes + 1
spare) whose batch script only holds it; the executor runs the "training" as steps in it
(``tests/fixtures/slurm/train_rank.py``).  Teardown cancels the job and resumes drained nodes.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.net import free_port_block, free_ports
from tests.waiting import wait_until
from trainguard.actions.executors.base import ExecutorEnv, StepContext
from trainguard.actions.executors.slurm import (
    SlurmExecutor,
    SlurmExecutorConfig,
    expand_hostlist,
    parse_record,
)
from trainguard.infra.config import load_settings
from trainguard.infra.stack.slurm import Slurm
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import JobSpec
from trainguard.schemas.topology import JobTopology

TRAIN_PY = Path(__file__).resolve().parents[1] / "fixtures" / "slurm" / "train_rank.py"
NODES = 6


def private_stack_env(home: Path, nodes: int) -> dict[str, str]:
    """The settings of a stack home of its own on free ports (Kafka, ClickHouse, a Slurm of
    ``nodes`` nodes), as ``TRAINGUARD_*`` variables: it never meets the shared test stack."""
    kafka, controller, http, tcp = free_ports(4)
    base = free_port_block(nodes + 1)  # slurmctld, then one port per slurmd
    return {
        "TRAINGUARD_HOME": str(home),
        "TRAINGUARD__STACK__KAFKA_PORT": str(kafka),
        "TRAINGUARD__STACK__KAFKA_CONTROLLER_PORT": str(controller),
        "TRAINGUARD__STACK__CLICKHOUSE_HTTP_PORT": str(http),
        "TRAINGUARD__STACK__CLICKHOUSE_TCP_PORT": str(tcp),
        "TRAINGUARD__STACK__SLURM_CTLD_PORT": str(base),
        "TRAINGUARD__STACK__SLURM_FIRST_NODE_PORT": str(base + 1),
    }


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    # Kafka/ClickHouse ports nobody listens on: nothing here may reach the running embedded stack.
    env = private_stack_env(tmp_path_factory.mktemp("slurm-home"), NODES)
    cluster = Slurm(load_settings(environ=env).stack, nodes=NODES)
    try:
        cluster.start()
        cluster.wait_idle(60)
        yield cluster
    finally:
        cluster.stop()


def ctx(step: str, decision: str = "", seconds: float = 30.0, category: str = "") -> StepContext:
    return StepContext(
        decision_id=decision or f"dec-{uuid.uuid4().hex[:8]}",
        step=step,
        attempt=1,
        deadline=time.monotonic() + seconds,
        category=category,
    )


def spec(job: str, active: list[str], standbys: list[str]) -> JobSpec:
    topo = JobTopology(job=job, tp=1, pp=1, dp=len(active), ranks_per_machine=1, machines=active)
    return JobSpec(job=job, ts_ms=now_ms(), topology=topo, standbys=standbys)


@dataclass
class TrainingJob:
    """One sbatch allocation on the test cluster, its executor and its training work dir."""

    cluster: Slurm
    name: str
    job_id: str
    work: Path
    executor: SlurmExecutor
    state_dir: Path

    def sh(self, *argv: str, timeout_s: float = 20.0) -> str:
        res = self.cluster.run(*argv, timeout_s=timeout_s)
        assert res.returncode == 0, f"{argv}: {res.stderr}"
        return res.stdout

    def show_job(self) -> dict[str, str]:
        return parse_record(self.sh("scontrol", "-o", "show", "job", self.job_id))

    def alloc_nodes(self) -> list[str]:
        return expand_hostlist(self.show_job().get("NodeList", ""))

    def node(self, name: str) -> dict[str, str]:
        return parse_record(self.sh("scontrol", "-o", "show", "node", name))

    def steps(self) -> list[tuple[str, str, list[str]]]:
        out = self.sh("squeue", "-h", "-s", "-j", self.job_id, "-o", "%i|%j|%N")
        rows = [line.split("|") for line in out.splitlines() if line.count("|") == 2]
        return [(i, n, expand_hostlist(nodes)) for i, n, nodes in rows]

    def training_steps(self) -> list[tuple[str, str, list[str]]]:
        return [s for s in self.steps() if s[1].startswith("tg-train")]

    def progress(self, node: str) -> list[list[str]]:
        path = self.work / f"progress-{node}.log"
        if not path.exists():
            return []
        return [line.split() for line in path.read_text().splitlines() if line.strip()]

    def checkpoint(self) -> int:
        try:
            return int((self.work / "checkpoint").read_text())
        except (OSError, ValueError):
            return 0

    def wait_progress(self, node: str, after_step: int, timeout_s: float = 30.0) -> list[str]:
        """The first progress line of ``node`` past ``after_step``."""

        def found() -> list[str] | None:
            return next((p for p in self.progress(node) if int(p[2]) > after_step), None)

        return wait_until(
            found, timeout_s, lambda: f"{node} past step {after_step}: {self.progress(node)[-3:]}"
        )

    def wait_generation(self, node: str, restart: int, timeout_s: float = 30.0) -> list[str]:
        """The first progress line of ``node`` written by the ``restart``-th launch of the step."""

        def found() -> list[str] | None:
            return next((p for p in self.progress(node) if p[3] == str(restart)), None)

        return wait_until(found, timeout_s, lambda: f"{node} in launch {restart}: {self.progress(node)[-3:]}")


def start_job(cluster: Slurm, tmp_path: Path, **options: Any) -> Iterator[TrainingJob]:
    """Submit a 4-node allocation (n1-n4) and build a Slurm executor for it; cleans up after."""
    name = f"tgtest-{uuid.uuid4().hex[:6]}"
    work = tmp_path / "work"
    work.mkdir()
    res = cluster.run(
        "sbatch", "--parsable", "-N", "4", "--ntasks-per-node=1", "-w", "n[1-4]", "-J", name,
        "-o", str(tmp_path / "batch-%j.out"), "--wrap", "exec sleep infinity",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip().split(";")[0]
    state_dir = tmp_path / "state"
    cfg = SlurmExecutorConfig(
        slurm_conf=str(cluster.conf_file),
        step_command=[sys.executable, str(TRAIN_PY), str(work)],
        **options,
    )
    job = TrainingJob(
        cluster, name, job_id, work, SlurmExecutor(cfg, ExecutorEnv(state_dir=state_dir)), state_dir
    )
    try:
        wait_until(lambda: job.show_job().get("JobState") == "RUNNING", 30, f"Slurm job {job_id} running")
        yield job
    finally:
        cluster.run("scancel", job_id)
        for n in cluster.nodes():
            if n["state"].startswith("drain"):
                cluster.run("scontrol", "update", f"NodeName={n['name']}", "State=RESUME")
        wait_until(
            lambda: all(not n["state"].startswith("drain") for n in cluster.nodes()),
            20,
            lambda: f"nodes resumed: {cluster.nodes()}",
        )
