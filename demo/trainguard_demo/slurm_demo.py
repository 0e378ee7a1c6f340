"""``trainguard demo --cluster slurm``: the demo job as a batch job on the stack's private Slurm.

The same tiny-GPT job, faults, stream worker and summary as :mod:`trainguard_demo.run`, but the
cluster is the real local Slurm of ``trainguard stack up --slurm`` (one ``slurmd`` per node, all on
this host) and recovery goes through the product's ``slurm`` executor:

* one allocation (``sbatch -N active+spares``) named after the job; the job script starts one
  exporter per node (``srun --overlap``, step ``tg-exporter``) and the training step on the first
  ``machines`` nodes through ``trainguard launch``, whose rank 0 publishes the job's spec (the
  other nodes of the allocation are its standbys), as a user's job script would
  (``infra/deploy/train.sbatch``);
* the action service drains an evicted node with the decision in the reason, cancels the training
  step, and starts a new one on the new node list (a spare in the evicted node's place, ranks in
  that order) from the latest checkpoint; a code push or rollback switches ``code/current`` (the
  executor's ``version_file``); stop-time tests run as steps (:mod:`trainguard_demo.slurm_node`);
* the summary adds every node's Slurm state and drain reason, read from ``scontrol`` at the end.

No baseline job (its cold requeues are the local demo's comparison) and no warm process pools: a
restarted step imports torch afresh, so recoveries take longer than the local demo's.  Drained
nodes stay drained after the run, for ``scontrol show node``; the next run resumes them.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click
import yaml

from trainguard.infra.config import Settings
from trainguard.infra.stack.manager import Stack
from trainguard.infra.stack.slurm import Slurm
from trainguard_demo.config import LaunchSpec, write_atomic
from trainguard_demo.run import Demo, DemoConfig
from trainguard_demo.slurm_node import base_spec_path, reference_path

#: the faults the demo injects under Slurm by default: one per recovery path of the executor
#: (evict + spare for Xid and NIC down, a group eviction for a hang, an in-place restart for a
#: crash, a code rollback for a bad push).
SLURM_SCENARIO: list[dict[str, Any]] = [
    {"fault": "xid", "machine": 0},
    {"fault": "crash", "machine": 1},
    {"fault": "user-error", "machine": 2},
    {"fault": "hang", "machine": 3},
    {"fault": "nic-down", "machine": 2},
]
#: spare nodes in the allocation: the default scenario evicts up to five (a hang's whole group).
SPARES = 5
_PYTHON = sys.executable


class SlurmDemo(Demo):
    """:class:`Demo` on the local Slurm; see the module docstring."""

    def __init__(self, settings: Settings, cfg: DemoConfig, scenario: list[dict[str, Any]], **kw: Any):
        super().__init__(settings, cfg, scenario, **kw)
        self.slurm_job_id = ""
        self.nodes_total = cfg.machines + SPARES
        self.slurm: Slurm | None = None

    # -- configuration ----------------------------------------------------------------------------
    def _node_names(self) -> set[str]:
        return {f"n{i}" for i in range(1, self.nodes_total + 1)}

    def _tg_bin(self) -> str:
        return self._tg()[0]

    def _rank_command(self) -> list[str]:
        c = self.cfg
        return [
            self._tg_bin(), "launch", "--job", self.job, "--tp", str(c.tp), "--pp", str(c.pp),
            "--dp", str(c.dp),
            # The node names do not resolve: every node is this host.
            "--master-addr", "127.0.0.1",
            "--reporter-socket", str(self.cluster / "machines" / "{node}" / "reporter.sock"),
            "--", _PYTHON, "-m", "trainguard_demo.slurm_node", "rank",
            "--cluster-dir", str(self.cluster), "--job", self.job,
        ]  # fmt: skip

    def _config_file(self) -> Path:
        path = super()._config_file()
        config = yaml.safe_load(path.read_text())
        assert self.slurm is not None
        config["actions"]["executor"] = "slurm"
        config["actions"]["executor_options"] = {
            "slurm_conf": str(self.slurm.conf_file),
            "job_name": "{job}",
            "tasks_per_node": self.cfg.ranks_per_machine,
            "step_command": self._rank_command(),
            "keep_steps": ["tg-exporter"],
            "diagnostic_commands": {
                "alignment": [
                    *(_PYTHON, "-m", "trainguard_demo.slurm_node", "check"),
                    *("--cluster-dir", str(self.cluster)),
                ],
            },
            "version_file": str(self.cluster / "code" / "current"),
            # No permit_job_expansion on the local Slurm, and a requeue would rerun the job script.
            "allow_expand": False,
            "allow_requeue": False,
            # Restarted steps import torch cold on two shared cores.
            "launch_timeout_s": 60.0,
        }
        config["actions"]["min_standbys"] = 1
        path.write_text(yaml.safe_dump(config))
        return path

    def _job_script(self) -> Path:
        c = self.cfg
        log = self.dir / "logs" / "slurm-job-%j.out"
        exporter = [_PYTHON, "-m", "trainguard_demo.slurm_node", "exporter", "--cluster-dir",
                    str(self.cluster), "--job", self.job]  # fmt: skip
        active = f"n[1-{c.machines}]" if c.machines > 1 else "n1"
        script = f"""#!/bin/bash
#SBATCH --job-name={self.job}
#SBATCH --nodes={self.nodes_total}
#SBATCH --nodelist=n[1-{self.nodes_total}]
#SBATCH --ntasks-per-node={c.ranks_per_machine}
#SBATCH --output={log}
# The demo's job script (written by trainguard demo --cluster slurm), shaped like
# infra/deploy/train.sbatch: one exporter per node, then the training through trainguard launch.
srun --overlap --job-name=tg-exporter --kill-on-bad-exit=0 --nodes={self.nodes_total} \\
     --ntasks={self.nodes_total} --ntasks-per-node=1 {" ".join(exporter)} &
exporters=$!
srun --job-name=tg-train --kill-on-bad-exit=1 --nodes={c.machines} --nodelist={active} \\
     --ntasks={c.machines * c.ranks_per_machine} --ntasks-per-node={c.ranks_per_machine} \\
     {" ".join(self._rank_command())}
echo "training step exited $?; the allocation stays for TrainGuard's restarts"
wait $exporters
"""
        path = self.dir / "job.sbatch"
        path.write_text(script)
        return path

    # -- the run ----------------------------------------------------------------------------------
    def _slurm_up(self) -> Slurm:
        slurm = Slurm(self.settings.stack)
        if slurm.running() and slurm.cfg.nodes < self.nodes_total:
            raise click.ClickException(
                f"the stack's Slurm runs {slurm.cfg.nodes} nodes; the demo needs {self.nodes_total} "
                f"({self.cfg.machines} active + {SPARES} spares): run `trainguard stack down` first"
            )
        nodes = slurm.cfg.nodes if slurm.running() else self.nodes_total
        report = Stack(self.settings).up(slurm=True, slurm_nodes=nodes)
        self.echo(f"[demo] stack with Slurm ({nodes} nodes): {report.seconds:.1f}s; run dir {self.dir}")
        slurm = Slurm(self.settings.stack)
        for node in slurm.nodes():  # an earlier run's evictions: this private cluster's nodes are ours
            if node["name"] in self._node_names() and node["state"].startswith("drain"):
                slurm.run("scontrol", "update", f"NodeName={node['name']}", "State=RESUME")
                self.echo(f"[demo] {node['name']} resumed (drained by an earlier run: {node['reason']})")
        return slurm

    def start(self) -> LaunchSpec:
        from trainguard.infra.stack.procs import port_in_use

        if port_in_use(self.cfg.web_port):
            raise click.ClickException(
                f"port {self.cfg.web_port} is in use: is another demo still running? (stop it first)"
            )
        self.slurm = self._slurm_up()
        c = self.cfg
        spec = LaunchSpec(
            job=self.job, cluster_dir=str(self.cluster), tp=c.tp, pp=c.pp, dp=c.dp,
            ranks_per_machine=c.ranks_per_machine, machines=[f"n{i}" for i in range(1, c.machines + 1)],
            steps=c.steps, resume=True, pg_timeout_s=60.0,
        )  # fmt: skip
        (self.cluster / "jobs").mkdir(parents=True, exist_ok=True)
        write_atomic(base_spec_path(self.cluster, self.job), spec.to_json())
        write_atomic(self.cluster / "jobs" / f"{self.job}.json", spec.to_json())
        write_reference(self.cluster)
        env = {"TRAINGUARD_CONFIG": str(self._config_file())}
        self._spawn("worker", [*self._tg(), "worker"], env)
        self._spawn("actions", [*self._tg(), "actions", "run"], env)
        self._wait_worker()
        res = self.slurm.run("sbatch", "--parsable", str(self._job_script()), timeout_s=30)
        if res.returncode != 0:
            raise click.ClickException(f"sbatch failed: {res.stderr.strip() or res.stdout.strip()}")
        self.slurm_job_id = res.stdout.strip().split(";")[0]
        self.echo(
            f"[demo] Slurm job {self.slurm_job_id} ({self.job}): tp{c.tp} pp{c.pp} dp{c.dp} on "
            f"{','.join(spec.machine_names())}, spares n[{c.machines + 1}-{self.nodes_total}]; "
            f"recovery through the slurm executor"
        )
        self._wait_first_steps(f"{self.dir / 'logs'} and `scontrol show job {self.slurm_job_id}`")
        return spec

    def cluster_summary(self) -> dict[str, Any]:
        return {"slurm": self.slurm_state()}

    def slurm_state(self) -> dict[str, Any]:
        """The job and every node of its allocation as Slurm reports them now."""
        assert self.slurm is not None
        nodes = [
            {"node": n["name"], "state": n["state"], "reason": n["reason"]}
            for n in self.slurm.nodes()
            if n["name"] in self._node_names()
        ]
        steps = self.slurm.run("squeue", "-h", "-s", "-j", self.slurm_job_id, "-o", "%i %j %N")
        return {
            "job_id": self.slurm_job_id,
            "nodes": nodes,
            "steps": steps.stdout.split("\n") if steps.returncode == 0 else [],
        }

    def stop(self) -> None:
        if self.slurm is not None and self.slurm_job_id:
            self.slurm.run("scancel", self.slurm_job_id)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                res = self.slurm.run("squeue", "-h", "-j", self.slurm_job_id, "-o", "%T")
                if res.returncode != 0 or not res.stdout.strip():
                    break
                time.sleep(1)
        super().stop()


def write_reference(cluster: Path) -> None:
    """The known-good alignment digest, computed here (the demo host counts as healthy)."""
    out = subprocess.run(
        [_PYTHON, "-m", "trainguard_demo.diagnostics", "alignment"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    path = reference_path(cluster)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, out.stdout.strip().splitlines()[-1])


def print_slurm(summary: dict[str, Any], echo: Any = click.echo) -> None:
    """The allocation's nodes: which were drained, and by which decision."""
    slurm = summary.get("slurm")
    if not slurm:
        return
    echo(f"\nSlurm job {slurm['job_id']}: nodes at the end (scontrol show node agrees)")
    for node in slurm["nodes"]:
        echo(f"  {node['node']:<5} {node['state']:<10} {node['reason']}")
    if slurm.get("steps"):
        echo("Steps: " + "; ".join(s for s in slurm["steps"] if s.strip()))
