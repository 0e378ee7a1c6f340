"""A demo machine's node agent: the command line of its exporter, started with the machine.

Every machine of the demo cluster -- the job's, the initial standbys and the standbys the action
service provisions later -- runs its own node exporter (``trainguard demo-exporter``: the
product's exporter with simulated GPUs) reading that machine's kernel log and sysfs tree
(:func:`trainguard_demo.inject.prepare_machine_root`), receiving its ranks' telemetry on
``machines/<m>/reporter.sock`` and dumping their stacks on request.  In production the exporter
is a DaemonSet or a systemd unit that comes with the node; here whoever brings a machine up
starts it, with this one command line, so no machine is ever invisible.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trainguard_demo.inject import kernel_log, prepare_machine_root


def exporter_argv(cluster_dir: Path, machine: str, job: str, python: str = sys.executable) -> list[str]:
    """``trainguard demo-exporter ...`` for ``machine`` of ``job`` (prepares the machine's root)."""
    root = prepare_machine_root(cluster_dir, machine)
    mdir = cluster_dir / "machines" / machine
    # Ranks are found by command line: a trainer, or a warm process of this machine.
    pattern = rf"trainguard_demo\.(trainer|standby) .*--machine {machine}( |$)"
    return [
        str(Path(python).with_name("trainguard")), "demo-exporter", "--node", machine, "--job", job,
        "--root", str(root), "--kernel-log", str(kernel_log(cluster_dir, machine)),
        "--state-dir", str(mdir / "exporter"), "--socket", str(mdir / "reporter.sock"),
        # NIC every 2 s: a link that stays down is confirmed by the rule's second sample 2 s
        # after the first (at 5 s that took 5-10 s of a 40-s gap), while a 1-s flap still shows
        # in one sample at most and stays tolerated.
        "--cmd-pattern", pattern, "--simulate-gpus", "8", "--interval", "nic=2",
    ]  # fmt: skip


def start_exporter(
    cluster_dir: Path, machine: str, job: str, log: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``machine``'s exporter in its own session, logging to ``log`` (default: the machine's
    ``logs/exporter.log``); settings (Kafka) come from the environment, as for every component."""
    log = log or cluster_dir / "machines" / machine / "logs" / "exporter.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            exporter_argv(cluster_dir, machine, job),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
