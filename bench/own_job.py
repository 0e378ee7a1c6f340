"""A job nobody here wrote, protected by following ``docs/protect-your-job.md``, on the local Slurm.

    .venv/bin/python bench/own_job.py --json [--train-s 180] [--gap-s 60] [--out-dir DIR]

The job is ``bench/user_job/train_ddp.py``: plain PyTorch DDP as the public tutorials write it,
plus the guide's four lines.  Everything else is the guide's blocks (``# own-job: NAME``), read
from the guide and run unchanged from a fresh job directory: the copy of
``infra/deploy/train.sbatch`` and its ``sbatch`` line, the configuration file, the worker and the
action service, all with default settings.  What the simulation adds goes through the environment
(the guide's "Measured on the local Slurm" says what and why).

After ``--train-s`` of training it injects, one after the other, each once the job trains again:

1. ``sigkill``: SIGKILL to a rank's training process;
2. ``sigkill-again``: SIGKILL to a rank on the other node, ``--gap-s`` after the first;
3. ``sigstop``: SIGSTOP to a rank (a hang; the other ranks wait in gloo);
4. ``xid``: an NVRM Xid 79 line in one node's kernel log.

The JSON: ``false_evictions`` (nodes evicted or drained that were no fault's culprit), and per
fault ``{fault, culprit_node, blamed_nodes, evicted_nodes, trains_again_s}``, where blamed nodes are
those the fault's decisions named, evicted nodes those the action service evicted for it, and
``trains_again_s`` the time from the injection to the first training step reported by a process
started after it (null: not within ``--recover-timeout-s``).  Exit status 0 when every fault was
blamed on its culprit's node alone, none of the healthy nodes was evicted and the job trained
again after each; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "protect-your-job.md"
SCRIPT = REPO / "bench" / "user_job" / "train_ddp.py"
BIN = Path(sys.executable).parent
#: the job name of the guide's blocks (``sbatch --job-name`` and ``actions.jobs``).
JOB = "ddp"
#: nodes of the guide's allocation (``sbatch --nodes``).
ALLOCATION = 5
#: an NVRM line as the driver prints it (format: NVIDIA's Xid documentation, "Xid 79: GPU has
#: fallen off the bus"), behind a dmesg-style timestamp.
XID_LINE = "[{uptime:.6f}] NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.\n"
#: the faults, in the order they are injected by default.
FAULTS = ("sigkill", "sigkill-again", "sigstop", "xid")
_BLOCK = re.compile(r"```[a-z]*\n# own-job: (?P<name>[\w.-]+)\n(?P<body>.*?)```", re.S)


def guide_blocks(text: str) -> dict[str, str]:
    """The guide's runnable blocks by name (the ``# own-job: NAME`` line dropped).

    >>> guide_blocks("x\\n```bash\\n# own-job: go\\necho hi\\n```\\n")
    {'go': 'echo hi\\n'}
    """
    blocks: dict[str, str] = {}
    for m in _BLOCK.finditer(text):
        if m["name"] in blocks:
            raise ValueError(f"the guide has two blocks named {m['name']!r}")
        blocks[m["name"]] = m["body"]
    return blocks


@dataclass
class Fault:
    """One injected fault and what TrainGuard did about it."""

    fault: str
    culprit_node: str
    injected_ms: int
    blamed_nodes: list[str] = field(default_factory=list)
    evicted_nodes: list[str] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    trains_again_s: float | None = None


@dataclass
class Rank:
    pid: int
    rank: int
    node: str
    state: str


def training_ranks() -> list[Rank]:
    """The job's live training processes on this host, with the node ``trainguard launch`` gave each.

    Every simulated node is this host, so the node comes from the environment the launcher set
    (``TRAINGUARD_NODE``), not from where the process runs.
    """
    ranks = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            if not any(part.endswith(b"train_ddp.py") for part in cmd) or b"launch" in cmd:
                continue
            env = dict(
                kv.split(b"=", 1) for kv in (entry / "environ").read_bytes().split(b"\0") if b"=" in kv
            )
            if env.get(b"TRAINGUARD_JOB") != JOB.encode():
                continue
            stat = (entry / "stat").read_text()
            state = stat.rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError):
            continue
        if state == "Z":
            continue
        node = env.get(b"TRAINGUARD_NODE", b"").decode()
        ranks.append(Rank(int(entry.name), int(env.get(b"RANK", b"-1")), node, state))
    return sorted(ranks, key=lambda r: r.rank)


class OwnJob:
    def __init__(self, args: argparse.Namespace) -> None:
        from trainguard.infra.config import load_settings
        from trainguard.infra.stack.slurm import Slurm

        self.args = args
        self.settings = load_settings()
        self.slurm = Slurm(self.settings.stack)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.dir = Path(args.out_dir or self.settings.stack.home_path / "own-job") / stamp
        self.job_dir = self.dir / "job"
        self.kmsg_dir = self.dir / "kmsg"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.slurm_job_id = ""
        self.started_ms = 0
        self.faults: list[Fault] = []
        self.env = dict(os.environ)
        self.env.update(
            {
                "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                "TRAINGUARD_SRC": str(REPO),
                "TRAINGUARD_HOME": str(self.settings.stack.home_path),
                "SLURM_CONF": str(self.slurm.conf_file),
                # The simulation: one kernel log file per node, no metrics port (all on one host).
                "EXPORTER_ARGS": f"--metrics-port 0 --kernel-log {self.kmsg_dir}/{{node}}.log",
                # A consumer group and service state of this run's own on a stack that other
                # runs used: nothing of theirs is replayed or remembered.
                "TRAINGUARD__WORKER__APP_ID": f"own-job-{stamp}",
                "TRAINGUARD__WORKER__AUTO_OFFSET_RESET": "latest",
                "TRAINGUARD__ACTIONS__STATE_DIR": str(self.dir / "actions-state"),
            }
        )

    def log(self, msg: str) -> None:
        print(f"[own-job {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    # -- setup ------------------------------------------------------------------------------------
    def stack_up(self) -> None:
        from trainguard.infra.stack.manager import Stack
        from trainguard.infra.stack.slurm import Slurm

        nodes = max(self.slurm.cfg.nodes if self.slurm.running() else 0, ALLOCATION + 1)
        if self.slurm.running() and self.slurm.cfg.nodes < ALLOCATION:
            raise SystemExit(f"the stack's Slurm has {self.slurm.cfg.nodes} nodes; {ALLOCATION} needed")
        Stack(self.settings).up(slurm=True, slurm_nodes=nodes)
        self.slurm = Slurm(self.settings.stack)
        for node in self.slurm.nodes():  # an earlier run's evictions
            if node["state"].startswith("drain") or "drain" in node["state"]:
                self.slurm.run("scontrol", "update", f"NodeName={node['name']}", "State=RESUME")
                self.log(f"{node['name']} resumed (drained earlier: {node['reason']})")
        stale = self.slurm.run("squeue", "-h", "-n", JOB, "-o", "%i")
        for job_id in stale.stdout.split():
            self.slurm.run("scancel", job_id)
            self.log(f"cancelled an earlier run's job {job_id}")

    def write_job_dir(self) -> dict[str, str]:
        blocks = guide_blocks(GUIDE.read_text())
        missing = {"submit", "trainguard.yaml", "worker", "actions"} - blocks.keys()
        if missing:
            raise SystemExit(f"{GUIDE}: no block named {sorted(missing)}")
        self.job_dir.mkdir(parents=True)
        self.kmsg_dir.mkdir(parents=True)
        for node in self.slurm.cfg.node_names:
            (self.kmsg_dir / f"{node}.log").write_text("")
        shutil.copy(SCRIPT, self.job_dir / SCRIPT.name)
        (self.job_dir / "trainguard.yaml").write_text(blocks["trainguard.yaml"])
        return blocks

    def spawn(self, name: str, script: str) -> None:
        out = (self.dir / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(
            ["bash", "-c", script], cwd=self.job_dir, env=self.env,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def submit(self, script: str) -> None:
        res = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script], cwd=self.job_dir, env=self.env,
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if res.returncode != 0:
            raise SystemExit(f"the guide's submit block failed: {res.stderr.strip() or res.stdout}")
        m = re.search(r"Submitted batch job (\d+)", res.stdout)
        if not m:
            raise SystemExit(f"no job id in sbatch's output: {res.stdout!r}")
        self.slurm_job_id = m[1]

    # -- observing --------------------------------------------------------------------------------
    def sql(self, name: str, **params: Any) -> list[dict[str, Any]]:
        argv = [str(BIN / "trainguard"), "sql", "run", name, "--format", "json"]
        for k, v in params.items():
            argv += ["-p", f"{k}={v}"]
        res = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            self.log(f"sql {name}: {res.stderr.strip()[-300:]}")
            return []
        text = res.stdout.strip()
        if not text:
            return []
        if text.startswith("["):
            return list(json.loads(text))
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def steps_since(self, since_ms: int) -> list[dict[str, Any]]:
        return self.sql("training_curve", job=JOB, rank=0, since_ms=since_ms)

    def wait_trains(self, after_ms: int, timeout_s: float) -> int | None:
        """ts_ms of the first step of rank 0 after ``after_ms``; None if none within the timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rows = [r for r in self.steps_since(after_ms) if int(r["ts_ms"]) > after_ms]
            if rows:
                return min(int(r["ts_ms"]) for r in rows)
            time.sleep(2)
        return None

    def wait_new_processes(self, old: set[int], timeout_s: float) -> int | None:
        """Unix ms when every rank of the job runs in a process started after the injection."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ranks = [r for r in training_ranks() if r.state != "T"]
            if len(ranks) >= self.world and not {r.pid for r in ranks} & old:
                return int(time.time() * 1000)
            time.sleep(0.5)
        return None

    # -- the run ----------------------------------------------------------------------------------
    def inject(self, fault: str, node_pick: str | None) -> Fault:
        ranks = [r for r in training_ranks() if r.state != "T"]
        nodes = sorted({r.node for r in ranks})
        if not ranks:
            raise SystemExit("no training process to inject into")
        node = node_pick if node_pick in nodes else nodes[-1]
        target = next(r for r in ranks if r.node == node)
        now_ms = int(time.time() * 1000)
        if fault.startswith("sigkill"):
            os.kill(target.pid, signal.SIGKILL)
        elif fault == "sigstop":
            os.kill(target.pid, signal.SIGSTOP)
        elif fault == "xid":
            uptime = float(Path("/proc/uptime").read_text().split()[0])
            with (self.kmsg_dir / f"{node}.log").open("a") as f:
                f.write(XID_LINE.format(uptime=uptime))
        self.log(f"{fault}: rank {target.rank} (pid {target.pid}) on {node}")
        return Fault(fault=fault, culprit_node=node, injected_ms=now_ms)

    def run_fault(self, fault: str, node_pick: str | None) -> Fault:
        old = {r.pid for r in training_ranks()}
        f = self.inject(fault, node_pick)
        self.faults.append(f)
        restarted = self.wait_new_processes(old, self.args.recover_timeout_s)
        if restarted is None:
            self.log(f"{fault}: the job was not restarted within {self.args.recover_timeout_s:.0f} s")
            return f
        left = self.args.recover_timeout_s - (restarted - f.injected_ms) / 1000
        first = self.wait_trains(restarted, max(left, 10.0))
        if first is not None:
            f.trains_again_s = round((first - f.injected_ms) / 1000, 1)
        self.log(f"{fault}: trains again after {f.trains_again_s} s")
        return f

    def attribute(self) -> list[str]:
        """Fill each fault's blamed and evicted nodes; the nodes evicted for no culprit."""
        decisions = self.sql("decisions", job=JOB, since_ms=self.started_ms)
        evictions = self.sql("evictions", job=JOB, since_ms=self.started_ms)
        bounds = [f.injected_ms for f in self.faults] + [2**62]
        for i, f in enumerate(self.faults):
            lo, hi = bounds[i], bounds[i + 1]
            mine = [d for d in decisions if lo <= int(d["ts_ms"]) < hi]
            f.decisions = [
                {"action": d["action"], "machines": d["machines"], "reason": str(d["reason"])[:200]}
                for d in mine
            ]
            f.blamed_nodes = sorted({m for d in mine if d["action"] != "restart" for m in d["machines"]})
            ids = {d["decision_id"] for d in mine}
            f.evicted_nodes = sorted({e["machine"] for e in evictions if e["decision_id"] in ids})
        culprits = {f.culprit_node for f in self.faults}
        evicted = {e["machine"] for e in evictions}
        drained = {
            n["name"]
            for n in self.slurm.nodes()
            if "drain" in n["state"] and "trainguard" in n["reason"].lower()
        }
        return sorted((evicted | drained) - culprits)

    def run(self) -> dict[str, Any]:
        a = self.args
        self.stack_up()
        blocks = self.write_job_dir()
        self.world = 2  # ACTIVE_NODES=2 x --ntasks-per-node=1 in the guide's submit block
        self.started_ms = int(time.time() * 1000)
        self.spawn("worker", blocks["worker"])
        self.spawn("actions", blocks["actions"])
        time.sleep(a.services_s)
        self.submit(blocks["submit"])
        self.log(f"Slurm job {self.slurm_job_id} submitted; run dir {self.dir}")
        if self.wait_trains(self.started_ms, a.start_timeout_s) is None:
            raise SystemExit(f"the job did not train within {a.start_timeout_s:.0f} s: see {self.dir}")
        self.log(f"training; faults in {a.train_s:.0f} s")
        time.sleep(a.train_s)
        for name in a.faults:
            ranks = training_ranks()
            if name == "sigkill-again" and self.faults:
                # The second crash comes --gap-s after the first, on another node.
                first = self.faults[0]
                time.sleep(max(0.0, a.gap_s - (time.time() * 1000 - first.injected_ms) / 1000))
                ranks = training_ranks()
                pick = next((r.node for r in ranks if r.node != first.culprit_node), None)
            elif name == "xid":
                pick = ranks[0].node if ranks else None  # rank 0's node: the rendezvous moves
            else:
                pick = ranks[-1].node if ranks else None
            self.run_fault(name, pick)
            if name != "sigkill" or "sigkill-again" not in a.faults:
                time.sleep(a.settle_s)
        false_evictions = self.attribute()
        return {
            "slurm_job_id": self.slurm_job_id,
            "run_dir": str(self.dir),
            "false_evictions": false_evictions,
            "faults": [{k: v for k, v in asdict(f).items() if k != "injected_ms"} for f in self.faults],
            "nodes": [
                {"node": n["name"], "state": n["state"], "reason": n["reason"]} for n in self.slurm.nodes()
            ],
        }

    def stop(self) -> None:
        if self.slurm_job_id:
            self.slurm.run("scancel", self.slurm_job_id)
        for name, proc in self.procs.items():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    self.log(f"{name} killed")


def verdict(result: dict[str, Any]) -> bool:
    """Every fault blamed on its culprit's node alone, no false eviction, trained again each time."""
    if result["false_evictions"]:
        return False
    for f in result["faults"]:
        if f["trains_again_s"] is None or set(f["blamed_nodes"]) - {f["culprit_node"]}:
            return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--train-s", type=float, default=180.0, help="training before the first fault")
    p.add_argument("--gap-s", type=float, default=60.0, help="between the two SIGKILLs")
    p.add_argument("--settle-s", type=float, default=15.0, help="after a fault's recovery")
    p.add_argument("--services-s", type=float, default=10.0, help="for the worker to join")
    p.add_argument("--start-timeout-s", type=float, default=180.0)
    p.add_argument("--recover-timeout-s", type=float, default=120.0)
    p.add_argument("--out-dir", default="")
    p.add_argument(
        "--faults",
        type=lambda v: v.split(","),
        default=list(FAULTS),
        help=f"comma-separated, in order (default: {','.join(FAULTS)})",
    )
    args = p.parse_args()
    if unknown := set(args.faults) - set(FAULTS):
        p.error(f"unknown fault(s) {sorted(unknown)}: choose from {', '.join(FAULTS)}")
    # SIGTERM (a test's or an operator's stop) ends the run through its finally: the Slurm job
    # cancelled, the worker and the action service stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run = OwnJob(args)
    try:
        result = run.run()
    finally:
        run.stop()
    ok = verdict(result)
    result["ok"] = ok
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for f in result["faults"]:
            print(
                f"{f['fault']:<14} culprit {f['culprit_node']:<4} "
                f"blamed {','.join(f['blamed_nodes']) or '-':<8} "
                f"evicted {','.join(f['evicted_nodes']) or '-':<8} trains again {f['trains_again_s']} s"
            )
        print(f"false evictions: {result['false_evictions'] or 'none'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
