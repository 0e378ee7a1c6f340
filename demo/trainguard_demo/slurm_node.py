"""What runs on a Slurm node of the demo under Slurm (``trainguard demo --cluster slurm``).

Three commands, each run by Slurm on a node (``$SLURMD_NODENAME`` names the demo machine):

* ``rank``: one rank of the demo job, started by ``trainguard launch`` (one per ``srun`` task).
  It takes the job's settings from ``jobs/<job>.base.json`` and its place from the launcher's
  environment (``RANK``, ``TRAINGUARD_MACHINES`` in rank order, ``MASTER_ADDR``/``MASTER_PORT``);
  rank 0 records the step's spec as ``jobs/<job>.json`` (what ``trainguard demo`` reads progress
  by and ``trainguard inject`` resolves machine numbers with).  It then *execs* the trainer, so
  the exporter finds the rank by its command line and py-spy dumps the trainer itself.
* ``exporter``: the node's exporter (:func:`trainguard_demo.node.exporter_argv`), execed; the job
  script runs one per node as the ``tg-exporter`` step (``srun --overlap``).
* ``check``: the stop-time alignment test on this node, run by the slurm executor as a
  diagnostics step: the reference step's parameter digest against the known-good one
  (``diagnostics/reference.json``, written by the demo at start); exit 0 = passed.

``python -m trainguard_demo.slurm_node {rank|exporter|check} --cluster-dir D [--job J]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from trainguard_demo.config import LaunchSpec, write_atomic


def base_spec_path(cluster_dir: Path, job: str) -> Path:
    return cluster_dir / "jobs" / f"{job}.base.json"


def reference_path(cluster_dir: Path) -> Path:
    return cluster_dir / "diagnostics" / "reference.json"


def _node() -> str:
    node = os.environ.get("SLURMD_NODENAME", "").strip()
    if not node:
        raise SystemExit("slurm_node: SLURMD_NODENAME is not set: run this as a Slurm step (srun)")
    return node


def rank_argv(cluster_dir: Path, job: str, environ: dict[str, str]) -> tuple[LaunchSpec, int, list[str]]:
    """(the step's spec, this rank, the trainer's command line) from the launcher's environment."""
    base = LaunchSpec.from_json(base_spec_path(cluster_dir, job).read_text())
    try:
        rank = int(environ["RANK"])
        machines = [m for m in environ["TRAINGUARD_MACHINES"].split(",") if m]
        port = int(environ["MASTER_PORT"])
    except (KeyError, ValueError) as exc:
        raise SystemExit(f"slurm_node rank: run under `trainguard launch` ({exc!r} missing or bad)") from None
    spec = replace(
        base, machines=machines, master_addr=environ.get("MASTER_ADDR", base.master_addr), master_port=port
    )
    return spec, rank, [sys.executable, "-m", "trainguard_demo.trainer", *spec.to_argv(rank)]


def run_rank(cluster_dir: Path, job: str) -> int:
    spec, rank, argv = rank_argv(cluster_dir, job, dict(os.environ))
    if rank == 0:
        write_atomic(cluster_dir / "jobs" / f"{job}.json", spec.to_json())
    # As the local launcher sets them: one thread per rank on shared cores, gloo on loopback.
    for key, value in (("PYTHONUNBUFFERED", "1"), ("OMP_NUM_THREADS", "1"), ("GLOO_SOCKET_IFNAME", "lo")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("PYTHONWARNINGS", "ignore:The pynvml package is deprecated:FutureWarning")
    os.execv(argv[0], argv)


def run_exporter(cluster_dir: Path, job: str) -> int:
    from trainguard_demo.node import exporter_argv

    argv = exporter_argv(cluster_dir, _node(), job)
    os.execv(argv[0], argv)


def run_check(cluster_dir: Path) -> int:
    """The alignment test against the known-good digest; prints one JSON line."""
    from trainguard_demo.diagnostics.tests import alignment_digest

    node = _node()
    try:
        expected = json.loads(reference_path(cluster_dir).read_text())["digest"]
    except (OSError, ValueError, KeyError) as exc:
        print(json.dumps({"node": node, "ok": False, "error": f"no reference digest: {exc}"}))
        return 2
    try:  # an injected arithmetic fault on this machine (trainguard inject ... gpu-lost)
        marks = json.loads((cluster_dir / "machines" / node / "diagnostics.json").read_text())
    except (OSError, ValueError):
        marks = {}
    digest = alignment_digest(bool(marks.get("perturb")))
    ok = digest == expected
    print(json.dumps({"node": node, "test": "alignment", "ok": ok, "digest": digest, "expected": expected}))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainguard_demo.slurm_node", description=__doc__)
    p.add_argument("command", choices=("rank", "exporter", "check"))
    p.add_argument("--cluster-dir", required=True)
    p.add_argument("--job", default="")
    a = p.parse_args(argv)
    cluster_dir = Path(a.cluster_dir)
    if a.command != "check" and not a.job:
        p.error(f"{a.command} needs --job")
    if a.command == "rank":
        return run_rank(cluster_dir, a.job)
    if a.command == "exporter":
        return run_exporter(cluster_dir, a.job)
    return run_check(cluster_dir)


if __name__ == "__main__":
    sys.exit(main())
