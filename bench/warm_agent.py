"""Restart-to-first-step of a 2-rank gloo DDP job: cold processes vs the product's warm node agent.

``python bench/warm_agent.py [--runs 3]`` (from the repository root) runs the agent tests' tiny
DDP job (``tests/agent/gloo_job.py``, one rank per machine, CPU) and prints, for each run and as
medians:

* cold: two fresh ``python gloo_job.py`` processes with the next generation's environment, from
  their start to both ranks' first step -- what a new ``srun`` step or pod costs once it has
  started the processes (the scheduler's own delay not counted);
* warm: two node agents (``trainguard.agent``, one per machine, zygotes with torch and
  ``torch._dynamo`` preloaded) each get a signed ``agent_restart`` over HTTP with a new
  generation and ``MASTER_PORT``; from the first command sent to both ranks' first step (killing
  the old ranks included).

The cold runs go first, with no agent running, so neither side's processes share the CPUs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.agent.harness import (  # noqa: E402 -- after the path: the harness lives in the tests
    JOB,
    free_port,
    make_code_root,
    make_keys,
    start_agent,
    wait_first_step,
    wait_warm,
)
from trainguard.agent import client  # noqa: E402


def cold(tmp: Path, out: Path, generation: int) -> float:
    """Seconds from starting both rank processes to both ranks' first step."""
    port = free_port()
    code = tmp / "code" / "v1"
    procs = []
    started = time.time()
    for rank in (0, 1):
        env = {
            **os.environ,
            "PYTHONPATH": str(code),
            "AGENT_TEST_OUT": str(out),
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TRAINGUARD_GENERATION": str(generation),
        }
        # Quiet: the survivor of the two kills below reports its lost peer at length.
        quiet = subprocess.DEVNULL
        procs.append(
            subprocess.Popen([sys.executable, "gloo_job.py"], cwd=code, env=env, stdout=quiet, stderr=quiet)
        )
    try:
        done = max(wait_first_step(out, rank, generation, timeout_s=300)["ts"] for rank in (0, 1))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return done - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="warm-agent-"))
    out = tmp / "out"
    out.mkdir()
    make_code_root(tmp, ["v1"])
    keys = make_keys(tmp)
    colds = [cold(tmp, out, 100 + i) for i in range(a.runs)]
    for i, s in enumerate(colds, 1):
        print(f"cold run {i}: restart to first step {s:.2f}s", flush=True)
    port = free_port()
    agents = {n: start_agent(tmp, keys, n, out, ["n1", "n2"], port) for n in ("n1", "n2")}
    warms = []
    try:
        for r in agents.values():
            wait_warm(r.agent.zygote)
        print(f"zygotes warm: imports took {[r.agent.zygote.import_s for r in agents.values()]}s", flush=True)
        for rank in (0, 1):
            wait_first_step(out, rank, 1)
        for i in range(a.runs):
            gen, port = 2 + i, free_port()
            time.sleep(1.0)  # the ranks train a little between restarts, as a job would
            sent = time.time()
            for name, r in agents.items():
                cmd = client.restart_command(JOB, name, gen, ["n1", "n2"], "127.0.0.1", port)
                status, reply = client.send(r.url, cmd, keys.signer)
                if status != 200 or reply["outcome"] != "done":
                    raise SystemExit(f"restart of {name} failed: {status} {reply}")
            done = max(wait_first_step(out, rank, gen, timeout_s=60)["ts"] for rank in (0, 1))
            warms.append(done - sent)
            print(f"warm run {i + 1}: restart to first step {warms[-1]:.2f}s", flush=True)
    finally:
        for r in agents.values():
            r.agent.stop()
    cm, wm = statistics.median(colds), statistics.median(warms)
    print(f"median of {a.runs}: cold {cm:.2f}s, warm {wm:.2f}s ({cm / wm:.0f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
