"""A warm standby rank process (ByteRobust §6.2): imported and ready, waiting to be activated.

``python -m trainguard.demo.standby --cluster-dir D --machine S --slot I`` imports torch and the
whole trainer (the slow part of a cold start), announces itself in
``machines/S/standby/slot-I.json`` and polls ``machines/S/standby/activate.json``.  The action
service activates the machine with :func:`trainguard.demo.launcher.activate_standby`, which writes
the job spec there with ``S`` in place of the evicted machine; slot ``I`` then becomes the
machine's ``I``-th rank and runs :func:`~trainguard.demo.trainer.run_rank` in this process, which
resumes from the latest complete checkpoint (its shards come from the backup peers, since S's own
disk has none).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from trainguard.demo.config import ClusterPaths, JobSpec, write_atomic
from trainguard.demo.trainer import run_rank


@dataclass(frozen=True)
class StandbyConfig:
    cluster_dir: str
    machine: str
    slot: int
    poll_s: float = 0.2


def wait_for_activation(cfg: StandbyConfig) -> tuple[JobSpec, int]:
    """Block until the machine is activated; returns the job and this slot's rank."""
    paths = ClusterPaths(Path(cfg.cluster_dir))
    status = paths.machine(cfg.machine) / "standby" / f"slot-{cfg.slot}.json"
    write_atomic(status, json.dumps({"status": "standby", "pid": os.getpid(), "ts": time.time()}))
    activation = paths.activation(cfg.machine)
    while True:
        try:
            spec = JobSpec.from_json(activation.read_text())
            break
        except FileNotFoundError:
            time.sleep(cfg.poll_s)
    ranks = spec.ranks_on(cfg.machine)
    if cfg.slot >= len(ranks):
        raise SystemExit(f"standby slot {cfg.slot} has no rank: machine {cfg.machine} holds ranks {ranks}")
    rank = ranks[cfg.slot]
    write_atomic(status, json.dumps({"status": "active", "pid": os.getpid(), "job": spec.job, "rank": rank}))
    return spec, rank


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainguard.demo.standby", description="a warm standby rank")
    p.add_argument("--cluster-dir", required=True)
    p.add_argument("--machine", required=True)
    p.add_argument("--slot", type=int, required=True)
    p.add_argument("--poll", type=float, default=0.2)
    a = p.parse_args(argv)
    spec, rank = wait_for_activation(StandbyConfig(a.cluster_dir, a.machine, a.slot, a.poll))
    os.environ["RANK"] = str(rank)  # for tools that look the rank up in the environment
    print(f"standby {a.machine}/{a.slot} activated as rank {rank} of job {spec.job}", flush=True)
    return run_rank(spec, rank)


if __name__ == "__main__":
    sys.exit(main())
