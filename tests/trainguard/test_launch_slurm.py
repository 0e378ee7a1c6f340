"""``trainguard launch`` and the per-job exporter on the real private Slurm, publishing to the real
broker of the test stack: the shipped example job script ``infra/deploy/train.sbatch``, no mocks.

One 3-node allocation (``sbatch -N 3 -w n[1-3] --ntasks-per-node=2``): the script starts an
exporter on every node as an ``srun --overlap`` step named ``tg-exporter``, then the training step
on n1-n2 (2 ranks each, tp 2 -> dp 2) running ``trainguard launch ... -- python train_rank.py``.
The first test reads the signed JobSpec (machines n1,n2; standby n3) and the exporters' heartbeats
and host samples from Kafka, checks the ranks' environment, then fails the ranks on n2 and checks
the exit codes reaching Slurm.  The second restarts the failed training with the real slurm
executor (n3 in place of n2): the restarted launchers publish no spec, and the script holds the
allocation while TrainGuard's step runs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.actions.slurm_fixture import NODES, TRAIN_PY, ctx
from tests.actions.slurm_fixture import slurm_cluster as slurm_cluster  # the fixture
from tests.exporter.kafka_helpers import TopicReader
from tests.waiting import wait_until
from trainguard.actions.executors.base import ExecutorEnv
from trainguard.actions.executors.slurm import SlurmExecutor, SlurmExecutorConfig, parse_record
from trainguard.infra.bus import verifier_for
from trainguard.infra.config import Settings
from trainguard.infra.stack.slurm import Slurm
from trainguard.launch_env import (
    LaunchConfig,
    derived_port,
    find_master,
    name_resolves,
    node_addr,
    plan_launch,
    scontrol_show_node,
)
from trainguard.schemas.base import now_ms
from trainguard.schemas.codec import decode
from trainguard.schemas.control import JobSpec
from trainguard.schemas.telemetry import Heartbeat, HostSample
from trainguard.schemas.topics import HEARTBEATS, HOST, JOBS
from trainguard.schemas.topology import JobTopology

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "infra" / "deploy" / "train.sbatch"
BIN = Path(sys.executable).parent
assert NODES >= 3


class JobsReader:
    """Raw records of the jobs topic from its current end (to check their signatures too)."""

    def __init__(self, settings: Settings) -> None:
        from kafka import KafkaConsumer, TopicPartition

        self.consumer: Any = KafkaConsumer(**settings.kafka.client_kwargs(), enable_auto_commit=False)
        parts = [TopicPartition(JOBS.name, p) for p in range(JOBS.partitions)]
        self.consumer.assign(parts)
        self.consumer.seek_to_end(*parts)
        for tp in parts:
            self.consumer.position(tp)

    def wait_for(self, job: str, timeout_s: float) -> Any:
        def found() -> Any:
            for records in self.consumer.poll(timeout_ms=300).values():
                for rec in records:
                    if rec.key == job.encode():
                        return rec
            return None

        return wait_until(found, timeout_s, f"the JobSpec of {job} on {JOBS.name}")

    def keys_seen(self, seconds: float) -> list[bytes]:
        """The keys of every record that arrives within ``seconds`` (a wait for what must not come)."""
        keys: list[bytes] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            keys += [rec.key for records in self.consumer.poll(timeout_ms=300).values() for rec in records]
        return keys

    def close(self) -> None:
        self.consumer.close()


@pytest.fixture
def readers(stack_settings: Settings) -> Iterator[tuple[JobsReader, TopicReader]]:
    jobs = JobsReader(stack_settings)
    telemetry = TopicReader(stack_settings.kafka, [HEARTBEATS.name, HOST.name])
    try:
        yield jobs, telemetry
    finally:
        jobs.close()
        telemetry.close()


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


@dataclass
class Submitted:
    job: str
    slurm_id: str
    work: Path
    run_dir: Path
    ready: Path
    out: Path

    def log(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else "(no batch output yet)"

    def ready_files(self, folder: Path, n: int = 4) -> dict[int, dict[str, Any]]:
        def found() -> dict[int, dict[str, Any]] | None:
            infos = [json.loads(f.read_text()) for f in folder.glob("rank-*.json")]
            return {i["rank"]: i for i in infos} if len(infos) == n else None

        return wait_until(found, 60, lambda: f"{n} ready files in {folder}; batch log: {self.log()}")


def submit(cluster: Slurm, settings: Settings, tmp_path: Path, hold_s: int) -> Submitted:
    """``sbatch -N 3 -w n[1-3] --ntasks-per-node=2 infra/deploy/train.sbatch python train_rank.py WORK``
    with the script's knobs set for this cluster: 2 active nodes x 2 ranks, tp 2."""
    job = f"tglaunch-{uuid.uuid4().hex[:8]}"
    sub = Submitted(job, "", tmp_path / "work", tmp_path / "run", tmp_path / "ready", tmp_path / "batch.out")
    sub.work.mkdir()
    env = {
        **cluster.env(),
        "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
        # The launchers and exporters reach the test stack's broker with its signing keys.
        "TRAINGUARD_HOME": str(settings.stack.home_path),
        "TRAINGUARD_JOB": job,
        "ACTIVE_NODES": "2",
        "TASKS_PER_NODE": "2",
        "LAUNCH_ARGS": f"--tp 2 --master-addr 127.0.0.1 --ready-file {sub.ready}/rank-{{rank}}.json",
        "TRAINGUARD_RUN_DIR": str(sub.run_dir),
        # No GPUs here, and the host's kernel log is not this test's business.
        "EXPORTER_ARGS": "--disable nvml --disable kernel_log --cmd-pattern train_rank --interval host=2",
        "HOLD_S": str(hold_s),
        "HOLD_POLL_S": "0.5",
        "TRAINGUARD": str(BIN / "trainguard"),
    }
    res = subprocess.run(
        ["sbatch", "--parsable", "-N", "3", "-w", "n[1-3]", "--ntasks-per-node=2", "-J", job,
         "-o", str(sub.out), "-D", str(REPO), str(SBATCH), sys.executable, str(TRAIN_PY), str(sub.work)],
        env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    sub.slurm_id = res.stdout.strip().split(";")[0]
    return sub


def test_sbatch_launch_publishes_the_spec_and_the_overlap_exporters_publish(
    slurm_cluster: Slurm, stack_settings: Settings, readers: tuple[JobsReader, TopicReader], tmp_path: Path
) -> None:
    jobs, telemetry = readers
    sub = submit(slurm_cluster, stack_settings, tmp_path, hold_s=0)
    job, slurm_id, work, run_dir = sub.job, sub.slurm_id, sub.work, sub.run_dir
    batch_log = sub.log
    try:
        # The spec, signed with the launcher's key: machines = the step's nodes, standbys = the rest.
        rec = jobs.wait_for(job, 90)
        verifier = verifier_for(stack_settings)
        assert verifier is not None
        principal = verifier.verify(
            rec.topic, rec.key, rec.value, rec.headers, rec.timestamp, (rec.topic, rec.partition, rec.offset)
        )
        assert principal == "launcher"
        spec = decode(rec.value, expect=JobSpec)
        assert isinstance(spec, JobSpec)
        t = spec.topology
        assert (t.job, t.tp, t.pp, t.dp, t.ranks_per_machine) == (job, 2, 1, 2, 2)
        assert t.machines == ["n1", "n2"] and spec.standbys == ["n3"]

        # Every rank ready, its training process running with the torch and reporter variables.
        by_rank = sub.ready_files(sub.ready)
        assert by_rank[0]["spec"]["state"] == "published" and by_rank[1]["spec"]["state"] == "not published"
        for rank, info in by_rank.items():
            node = f"n{rank // 2 + 1}"
            seen = _environ(info["pid"])
            assert {k: seen[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == {
                "RANK": str(rank),
                "WORLD_SIZE": "4",
                "LOCAL_RANK": str(rank % 2),
                "LOCAL_WORLD_SIZE": "2",
            }
            assert (seen["MASTER_ADDR"], seen["MASTER_PORT"]) == ("127.0.0.1", str(derived_port(slurm_id)))
            assert (seen["TRAINGUARD_JOB"], seen["TRAINGUARD_NODE"], seen["SLURMD_NODENAME"]) == (
                job,
                node,
                node,
            )
            assert seen["TRAINGUARD_REPORTER_SOCKET"] == str(run_dir / node / "reporter.sock")
        # The "training" runs: every rank logs steps ("node rank step restart version" lines).
        wait_until(
            lambda: {line.split()[1] for line in _progress(work)} == {"0", "1", "2", "3"}, 30, "4 ranks"
        )

        # The exporters run beside the training as their own step, one per node, standby included.
        steps = slurm_cluster.run("squeue", "-h", "-s", "-j", slurm_id, "-o", "%j|%N").stdout
        assert "tg-exporter|n[1-3]" in steps and "tg-train|n[1-2]" in steps, steps
        got = telemetry.read_until(
            lambda e: getattr(e, "job", "") == job and isinstance(e, Heartbeat | HostSample),
            lambda evs: (
                {e.node for e in evs if isinstance(e, Heartbeat)} == {"n1", "n2", "n3"}
                and {e.node for e in evs if isinstance(e, HostSample)} == {"n1", "n2", "n3"}
            ),
            timeout_s=60,
        )
        assert {e.node for e in got if isinstance(e, Heartbeat) and e.component == "exporter"} == {
            "n1",
            "n2",
            "n3",
        }, f"{got}; batch log: {batch_log()}"
        assert all((run_dir / n / "reporter.sock").is_socket() for n in ("n1", "n2", "n3"))

        # The ranks on n2 fail (exit 3) and their launchers exit 3; srun (--kill-on-bad-exit) stops
        # the other ranks with SIGTERM, which their launchers pass on: they exit 143 (a rank on n2
        # that had not seen the fault yet too), and srun returns the highest code.  No launcher
        # dies of a signal itself.  The script (HOLD_S=0) then stops the exporters with SIGTERM
        # (they exit by themselves, not killed) and ends the job with srun's code.
        (work / "fault-n2").touch()
        wait_until(
            lambda: _job(slurm_cluster, slurm_id).get("JobState") in ("FAILED", "COMPLETED"),
            60,
            lambda: f"job {slurm_id} ended: {_job(slurm_cluster, slurm_id)}; batch log: {batch_log()}",
        )
        shown, log = _job(slurm_cluster, slurm_id), batch_log()
        assert re.search(r"n2: tasks? [23](-3)?: Exited with exit code 3\n", log), log
        assert "n1: tasks 0-1: Exited with exit code 143" in log and "Terminated" not in log, log
        assert (shown["JobState"], shown["ExitCode"]) == ("FAILED", "143:0"), f"{shown}; {log}"
        assert "Killed" not in log, log
        assert f"trainguard launch: job {job} rank 0 on n1 ready" in log
    finally:
        slurm_cluster.run("scancel", slurm_id)


def _progress(work: Path) -> list[str]:
    return [line for f in work.glob("progress-*.log") for line in f.read_text().splitlines()]


def _job(cluster: Slurm, job_id: str) -> dict[str, str]:
    return parse_record(cluster.run("scontrol", "-o", "show", "job", job_id).stdout)


def test_a_step_the_slurm_executor_restarts_publishes_no_spec_and_the_script_holds_for_it(
    slurm_cluster: Slurm, stack_settings: Settings, readers: tuple[JobsReader, TopicReader], tmp_path: Path
) -> None:
    jobs, _ = readers
    sub = submit(slurm_cluster, stack_settings, tmp_path, hold_s=8)
    try:
        jobs.wait_for(sub.job, 90)  # the job's own spec, from rank 0 of the script's step
        sub.ready_files(sub.ready)
        # The training step fails; the script keeps the allocation for TrainGuard's restart.
        (sub.work / "fault-n2").touch()
        wait_until(
            lambda: "holding the allocation" in sub.log(), 30, lambda: f"the script holding: {sub.log()}"
        )
        (sub.work / "fault-n2").unlink()

        # The action service restarts the training with the real slurm executor: the standby n3 in
        # place of n2, the same launcher as the executor's step_command.
        again = tmp_path / "ready-restart"
        cfg = SlurmExecutorConfig(
            slurm_conf=str(slurm_cluster.conf_file),
            tasks_per_node=2,
            step_command=[
                str(BIN / "trainguard"), "launch", "--job", sub.job, "--tp", "2", "--master-addr", "127.0.0.1",
                "--ready-file", f"{again}/rank-{{rank}}.json", "--", sys.executable, str(TRAIN_PY), str(sub.work),
            ],
        )  # fmt: skip
        executor = SlurmExecutor(cfg, ExecutorEnv(state_dir=tmp_path / "state"))
        topo = JobTopology(job=sub.job, tp=2, dp=2, ranks_per_machine=2, machines=["n1", "n3"])
        executor.restart(JobSpec(job=sub.job, ts_ms=now_ms(), topology=topo, standbys=["n2"]), ctx("restart"))
        restarted = sub.ready_files(again)
        assert [restarted[r]["node"] for r in range(4)] == ["n1", "n1", "n3", "n3"]
        assert _environ(restarted[0]["pid"])["TRAINGUARD_RESTART"] == "1"
        # Rank 0 of a restarted step publishes nothing: the service's spec stands (latest wins).
        assert restarted[0]["spec"]["state"] == "not published"
        # Slurm writes the step's output to its log file on its own time: wait for the line.
        step_log = tmp_path / "state" / "slurm" / sub.job / "step-1.log"
        said = "step restarted by the action service (TRAINGUARD_RESTART=1): its spec stands"
        wait_until(lambda: said in step_log.read_text(), 10, lambda: f"{said!r} in {step_log.read_text()}")
        assert sub.job.encode() not in jobs.keys_seen(3.0)

        # The script holds while TrainGuard's step runs, longer than HOLD_S after the failure ...
        time.sleep(9)  # lets HOLD_S (8 s) pass: a deliberate wait, not synchronisation
        assert _job(slurm_cluster, sub.slurm_id)["JobState"] == "RUNNING", sub.log()
        # ... and ends HOLD_S after the last one, with the exporters stopped and a success.
        (sub.work / "fault-n3").touch()
        wait_until(
            lambda: _job(slurm_cluster, sub.slurm_id).get("JobState") not in ("RUNNING", "COMPLETING"),
            60,
            lambda: f"job {sub.slurm_id} ended: {_job(slurm_cluster, sub.slurm_id)}; {sub.log()}",
        )
        shown, log = _job(slurm_cluster, sub.slurm_id), sub.log()
        assert (shown["JobState"], shown["ExitCode"]) == ("COMPLETED", "0:0"), f"{shown}; {log}"
        assert "the training went on in steps TrainGuard restarted" in log and "Killed" not in log, log
    finally:
        slurm_cluster.run("scancel", sub.slurm_id)


def test_the_launcher_finds_the_master_without_master_addr(slurm_cluster: Slurm, tmp_path: Path) -> None:
    # The local stack's nodes are declared NodeAddr=127.0.0.1: a name that does not resolve
    # gets that address from the real scontrol.
    env = slurm_cluster.env()
    assert node_addr(scontrol_show_node("n1", env)) == "127.0.0.1"
    task = {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
            "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NODELIST": "n[1-2]"}  # fmt: skip
    cfg = LaunchConfig(job="tgmaster")
    found = find_master(plan_launch(cfg, task), cfg, env, resolves=lambda name: False)
    assert (found.master_addr, found.master_from.split(" (")[0]) == ("127.0.0.1", "NodeAddr of n1")

    # The whole launcher under srun, no --master-addr: both ranks agree on rank 0's node's address,
    # by name where this host resolves n1 (a hosts entry), by NodeAddr where it does not.
    ready = tmp_path / "ready"
    res = subprocess.run(
        ["srun", "-N", "2", "-w", "n[1-2]", "--ntasks-per-node=1", "--job-name=tg-train",
         str(BIN / "trainguard"), "launch", "--job", "tgmaster", "--no-publish",
         "--reporter-socket", str(tmp_path / "no-exporter.sock"), "--ready-file", f"{ready}/rank-{{rank}}.json",
         "--", sys.executable, "-c", "import os; print('MASTER', os.environ['RANK'], os.environ['MASTER_ADDR'])"],
        env={**env, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "TRAINGUARD_HOME": str(tmp_path / "home")},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    infos = [json.loads((ready / f"rank-{r}.json").read_text()) for r in (0, 1)]
    expected = ("n1", "rank 0's node n1") if name_resolves("n1") else ("127.0.0.1", "NodeAddr of n1")
    for info in infos:
        assert (info["master_addr"], info["master_from"].split(" (")[0]) == expected, info
    said = sorted(ln for ln in res.stdout.splitlines() if ln.startswith("MASTER"))
    assert said == [f"MASTER 0 {expected[0]}", f"MASTER 1 {expected[0]}"], res.stdout
    assert f"trainguard launch: master address {expected[0]}: {expected[1]}" in res.stderr, res.stderr
