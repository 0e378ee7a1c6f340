"""What a pod of the demo runs on the stack's Kubernetes (``trainguard demo --cluster k8s``).

The stack's pod runner starts these as the pods' container commands (see
:mod:`trainguard.infra.stack.podrunner`); ``$TRAINGUARD_NODE`` names the demo machine (the pod's node).

* ``machine``: one machine of the demo job, as torchrun would run it in a JobSet's pod: it
  starts the machine's ``ranks_per_machine`` trainer processes (ranks
  ``index * rpm .. index * rpm + rpm - 1`` from the kubernetes executor's
  ``TRAINGUARD_MACHINE_INDEX`` / ``TRAINGUARD_MACHINES``), forwards SIGTERM to them and exits
  with the first failing rank's code (the others are stopped then: the group is dead anyway).
  A restarted pod (``TRAINGUARD_RESTART``) rendezvouses on a port of its own generation; a code
  version from the job's ConfigMap (``TRAINGUARD_CODE_VERSION``, the executor's hot update) is
  switched in before the ranks start.  Rank 0's machine records the spec as ``jobs/<job>.json``.
* ``exporter``: the node's exporter (the demo's DaemonSet), execed.
* ``check``: the stop-time alignment test on this node (as under Slurm).
* ``standby``: a warm standby's self-check -- the same alignment test -- then it holds the node
  with ``standby-ready/<node>`` written, the file its readiness probe tests
  (:func:`standby_probe`); a failing check exits 1, and the executor cordons the node.

``python -m trainguard_demo.k8s_node {machine|exporter|check|standby} --cluster-dir D [--job J]``
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import FrameType

from trainguard_demo.config import LaunchSpec, write_atomic
from trainguard_demo.slurm_node import base_spec_path, run_check

#: rendezvous ports: generation g of the job uses PORT_BASE + g % PORT_SPAN.
PORT_BASE, PORT_SPAN = 31000, 500


def _node() -> str:
    node = os.environ.get("TRAINGUARD_NODE", "").strip()
    if not node:
        raise SystemExit("k8s_node: TRAINGUARD_NODE is not set: run this in a pod (spec.nodeName)")
    return node


def machine_plan(cluster_dir: Path, job: str, environ: dict[str, str]) -> tuple[LaunchSpec, list[int]]:
    """(the job's spec for this generation, this machine's ranks) from the executor's environment."""
    base = LaunchSpec.from_json(base_spec_path(cluster_dir, job).read_text())
    try:
        index = int(environ["TRAINGUARD_MACHINE_INDEX"])
        machines = [m for m in environ["TRAINGUARD_MACHINES"].split(",") if m]
        generation = int(environ.get("TRAINGUARD_RESTART", "0"))
    except (KeyError, ValueError) as exc:
        raise SystemExit(f"k8s_node machine: not started by the kubernetes executor ({exc!r})") from None
    spec = replace(base, machines=machines, master_port=PORT_BASE + generation % PORT_SPAN)
    rpm = spec.ranks_per_machine
    return spec, list(range(index * rpm, (index + 1) * rpm))


def run_machine(cluster_dir: Path, job: str) -> int:
    spec, ranks = machine_plan(cluster_dir, job, dict(os.environ))
    version = os.environ.get("TRAINGUARD_CODE_VERSION", "").strip()
    if version:
        from trainguard_demo.codever import current_version, set_version

        if current_version(cluster_dir) != version:
            set_version(cluster_dir, version)
    if 0 in ranks:
        write_atomic(cluster_dir / "jobs" / f"{job}.json", spec.to_json())
    env = {
        **os.environ,
        # The node's exporter listens here (the DaemonSet's pod on this node).
        "TRAINGUARD_REPORTER_SOCKET": str(cluster_dir / "machines" / _node() / "reporter.sock"),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONWARNINGS": "ignore:The pynvml package is deprecated:FutureWarning",
    }
    children = [
        subprocess.Popen([sys.executable, "-m", "trainguard_demo.trainer", *spec.to_argv(rank)], env=env)
        for rank in ranks
    ]

    def forward(signum: int, frame: FrameType | None) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        codes = [c.poll() for c in children]
        failed = [c for c in codes if c not in (None, 0)]
        if failed or all(c is not None for c in codes):
            break
        time.sleep(0.2)
    for child in children:  # one rank died: the rest of this machine's group goes too
        if child.poll() is None:
            child.terminate()
    for child in children:
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
    code = next((c.returncode for c in children if c.returncode), 0)
    return 128 - code if code < 0 else code


def ready_file(cluster_dir: Path, node: str) -> Path:
    return cluster_dir / "standby-ready" / node


def standby_probe(cluster_dir: Path) -> dict[str, object]:
    """The standby's readiness probe (a Probe manifest): its ready file exists."""
    return {
        "exec": {"command": ["sh", "-c", f'test -f "{cluster_dir}/standby-ready/$TRAINGUARD_NODE"']},
        "periodSeconds": 2,
        "failureThreshold": 1,
    }


def run_standby(cluster_dir: Path) -> int:
    """Self-check, then hold the node Ready until SIGTERM (the ready file goes with it)."""
    ready = ready_file(cluster_dir, _node())
    ready.unlink(missing_ok=True)  # a standby killed before left its file: not this one's pass
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # The demo's "nodes" share this host's cores: a standby checking itself (torch import, the
    # alignment test) while a restarted job's ranks start would slow their restart, which on
    # real nodes it never could.  It yields to them instead.
    os.nice(19)
    try:
        code = run_check(cluster_dir)
        if code:
            return code
        ready.parent.mkdir(parents=True, exist_ok=True)
        ready.write_text(f"{os.getpid()}\n")
        while True:
            signal.pause()
    finally:
        ready.unlink(missing_ok=True)


def run_exporter(cluster_dir: Path, job: str) -> int:
    from trainguard_demo.node import exporter_argv

    argv = exporter_argv(cluster_dir, _node(), job)
    os.execv(argv[0], argv)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainguard_demo.k8s_node", description=__doc__)
    p.add_argument("command", choices=("machine", "exporter", "check", "standby"))
    p.add_argument("--cluster-dir", required=True)
    p.add_argument("--job", default="")
    a = p.parse_args(argv)
    cluster_dir = Path(a.cluster_dir)
    if a.command not in ("check", "standby") and not a.job:
        p.error(f"{a.command} needs --job")
    if a.command == "machine":
        return run_machine(cluster_dir, a.job)
    if a.command == "exporter":
        return run_exporter(cluster_dir, a.job)
    os.environ.setdefault("SLURMD_NODENAME", _node())  # run_check names the node by Slurm's variable
    if a.command == "standby":
        return run_standby(cluster_dir)
    return run_check(cluster_dir)


if __name__ == "__main__":
    sys.exit(main())
