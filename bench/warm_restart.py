"""Restart cost of the demo job: cold start vs waking warm pools forked by each machine's zygote.

``python bench/warm_restart.py [--restarts 3]`` runs the demo's tiny GPT (tp2 pp2 dp2, 4 machines
of 2 ranks) in a temporary cluster and prints:

* cold start: launch to every rank's first step (new interpreters importing torch);
* per warm restart: stop every rank, wake each machine's ready pool with a new rendezvous port,
  time to every rank's first step; then how long the zygotes take to have the next pools ready.

The restart-to-first-step time is what each recovery costs the job's ETTR on top of detection.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from trainguard_demo.config import LaunchSpec
from trainguard_demo.launcher import (
    activate_standby,
    launch_job,
    new_pool,
    read_progress,
    ready_pools,
    start_zygote,
    stop_job,
)
from trainguard_demo.zygote import zygote_pid


def _first_step_after(spec: LaunchSpec, t0: float, timeout_s: float = 300) -> float:
    """Seconds from ``t0`` until every rank of ``spec`` reported a step after ``t0``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        prog = read_progress(spec)
        if len(prog) == spec.world_size and all(
            p.get("status") == "running" and p.get("ts", 0) > t0 for p in prog.values()
        ):
            return time.time() - t0
        time.sleep(0.02)
    raise TimeoutError(f"no step from every rank within {timeout_s} s")


def _wait(pred: Callable[[], object], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        time.sleep(0.02)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--port", type=int, default=29880)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="warm-restart-"))
    machines = [f"m{i}" for i in range(4)]
    spec = LaunchSpec(job="bench", cluster_dir=str(tmp), tp=2, pp=2, dp=2, ranks_per_machine=2,
                   machines=machines, steps=1_000_000, master_port=a.port, pg_timeout_s=60)  # fmt: skip
    zygotes = [start_zygote(tmp, m) for m in machines]
    try:
        _wait(lambda: all(zygote_pid(tmp, m) for m in machines))
        t0 = time.time()
        job = launch_job(spec)
        print(f"cold start (8 new interpreters) to first step: {_first_step_after(spec, t0):6.2f} s")
        for m in machines:
            new_pool(tmp, m, spec.ranks_per_machine)
        _wait(lambda: all(ready_pools(tmp, m, 2) for m in machines))
        stop_job(job, grace_s=0)
        for n in range(1, a.restarts + 1):
            gen = replace(spec, master_port=a.port + n)
            t0 = time.time()
            for m in machines:
                activate_standby(gen, m)
            woke = _first_step_after(gen, t0)
            t1 = time.time()
            for m in machines:
                new_pool(tmp, m, spec.ranks_per_machine)
            _wait(lambda: all(ready_pools(tmp, m, 2) for m in machines))
            ready = time.time() - t1
            print(f"warm restart {n}: to first step {woke:5.2f} s; next pools ready in {ready:5.2f} s")
            # Stop this generation (the next one wakes the pools just made ready).
            subprocess.run(["pkill", "-f", "--", f"--master-port {a.port + n} "], check=False)
            time.sleep(1.0)
    finally:
        subprocess.run(["pkill", "-f", str(tmp)], check=False)
        for z in zygotes:
            stop_job(z, grace_s=0)


if __name__ == "__main__":
    main()
