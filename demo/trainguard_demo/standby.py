"""A warm rank process (ByteRobust §6.2): imported and ready, waiting to be activated.

``python -m trainguard_demo.standby --cluster-dir D --machine S --pool P --slot I`` imports torch
and the whole trainer (the slow part of a cold start), announces itself in
``machines/S/standby/P/slot-I.json`` and polls ``machines/S/standby/P/activate.json``.  Slots
of one pool are woken together: :func:`trainguard_demo.launcher.activate_standby` writes the job
spec there, and slot ``I`` becomes the machine's ``I``-th rank and runs
:func:`~trainguard_demo.trainer.run_rank` in this process, resuming from the latest complete
checkpoint (from the backup peers when the machine's own disk has none).

Pools serve two purposes: a *standby machine* (one that replaces an evicted machine) and the
*warm restart* of a job's own machines -- after each restart the local executor starts a fresh
pool on every machine of the job, so the next restart wakes processes instead of cold-starting
them (:mod:`trainguard_demo.executor`).  ``--warm-delay`` postpones the heavy imports so a pool
started right after a restart does not compete with the ranks that are resuming.

Once activated, the process renames itself (``setproctitle``) to the command line the trainer
would have had (``python -m trainguard_demo.trainer --job J --rank R --machine S ...``):
node agents and operators find ranks by their command line, and a woken standby must look like
the rank it has become, not like an idle spare.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from trainguard_demo.config import ClusterPaths, LaunchSpec, write_atomic


@dataclass(frozen=True)
class StandbyConfig:
    cluster_dir: str
    machine: str
    slot: int
    pool: str = "0"
    poll_s: float = 0.1


def wait_for_activation(cfg: StandbyConfig) -> tuple[LaunchSpec, int]:
    """Block until the pool is activated; returns the job and this slot's rank."""
    paths = ClusterPaths(Path(cfg.cluster_dir))
    status = paths.pool(cfg.machine, cfg.pool) / f"slot-{cfg.slot}.json"
    write_atomic(status, json.dumps({"status": "standby", "pid": os.getpid(), "ts": time.time()}))
    # The machine's first ready moment per slot, kept (the status above changes on activation):
    # the demo's summary measures a standby's time to ready from it.
    first = paths.machine(cfg.machine) / f"ready.{cfg.slot}"
    if not first.exists():
        write_atomic(first, f"{time.time()}\n")
    activation = paths.activation(cfg.machine, cfg.pool)
    while True:
        try:
            spec = LaunchSpec.from_json(activation.read_text())
            break
        except FileNotFoundError:
            time.sleep(cfg.poll_s)
    ranks = spec.ranks_on(cfg.machine)
    if cfg.slot >= len(ranks):
        raise SystemExit(f"standby slot {cfg.slot} has no rank: machine {cfg.machine} holds ranks {ranks}")
    rank = ranks[cfg.slot]
    write_atomic(status, json.dumps({"status": "active", "pid": os.getpid(), "job": spec.job, "rank": rank}))
    return spec, rank


def become_rank(spec: LaunchSpec, rank: int) -> None:
    """Take the identity of ``rank``: environment for code in this process, title for outsiders."""
    import setproctitle

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(spec.world_size), LOCAL_RANK=str(rank % spec.ranks_per_machine),
        TRAINGUARD_JOB=spec.job, TRAINGUARD_NODE=spec.machine_of_rank(rank),
    )  # fmt: skip
    setproctitle.setproctitle(
        " ".join([sys.executable, "-m", "trainguard_demo.trainer", *spec.to_argv(rank)])
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainguard_demo.standby", description="a warm standby rank")
    p.add_argument("--cluster-dir", required=True)
    p.add_argument("--machine", required=True)
    p.add_argument("--slot", type=int, required=True)
    p.add_argument("--pool", default="0")
    p.add_argument("--poll", type=float, default=0.1)
    p.add_argument("--warm-delay", type=float, default=0.0, help="seconds to wait before importing torch")
    a = p.parse_args(argv)
    if a.warm_delay > 0:
        time.sleep(a.warm_delay)
    from trainguard_demo.trainer import prewarm  # the heavy part: torch and the model code

    prewarm()
    return serve_slot(StandbyConfig(a.cluster_dir, a.machine, a.slot, a.pool, a.poll))


def serve_slot(cfg: StandbyConfig) -> int:
    """Announce the slot, wait for activation, then run the rank in this process."""
    from trainguard_demo.trainer import run_rank

    spec, rank = wait_for_activation(cfg)
    become_rank(spec, rank)
    print(
        f"standby {cfg.machine}/{cfg.pool}/{cfg.slot} activated as rank {rank} of job {spec.job}", flush=True
    )
    return run_rank(spec, rank)


if __name__ == "__main__":
    sys.exit(main())
