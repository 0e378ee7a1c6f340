"""Fault injection into the demo cluster (`trainguard inject`).

Machine-level faults land where a real machine would show them, so the exporter and the stream
workers detect them the same way as in production: Xid and GPU-lost lines are appended to the
machine's kernel log, a NIC going down or flapping is written into its sysfs tree; a machine
freeze (``machine-freeze``: a kernel lockup, a node lost) stops every process of the machine --
its exporter and its ranks -- with SIGSTOP, so it sends nothing at all, and lets them go on
after :data:`FREEZE_S` (the node back up; by then a recovery has killed its ranks).  Training
faults (hangs, slow rank, NaN, crash, user error, OOM) go through the ranks' fault hooks
(:mod:`trainguard_demo.faults`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from trainguard.infra.config import Settings
from trainguard_demo import faults

MACHINE_FAULTS = ("xid", "nic-down", "nic-flap", "gpu-lost", "machine-freeze")
#: how long a frozen machine stays frozen.
FREEZE_S = 20.0
ALL_FAULTS = (*MACHINE_FAULTS, *faults.KINDS)
NIC = "ib0"


def machine_root(cluster_dir: Path, machine: str) -> Path:
    return cluster_dir / "machines" / machine / "root"


def kernel_log(cluster_dir: Path, machine: str) -> Path:
    return machine_root(cluster_dir, machine) / "var" / "log" / "kern.log"


def prepare_machine_root(cluster_dir: Path, machine: str) -> Path:
    """A machine's system tree: its own NIC and kernel log, the host's real /proc."""
    root = machine_root(cluster_dir, machine)
    nic = root / "sys" / "class" / "net" / NIC
    (nic / "statistics").mkdir(parents=True, exist_ok=True)
    for name, value in (("operstate", "up"), ("carrier", "1"), ("carrier_changes", "2"), ("type", "32")):
        (nic / name).write_text(value + "\n")
    for name in ("rx_bytes", "tx_bytes", "rx_errors", "tx_errors", "rx_dropped", "tx_dropped"):
        (nic / "statistics" / name).write_text("0\n")
    # The exporter watches only interfaces with hardware behind them (a ``device`` link), as on
    # a real machine, where ib0's leads to its HCA's PCI function.
    pci = root / "sys" / "devices" / "pci0000:00" / "0000:5e:00.0"
    pci.mkdir(parents=True, exist_ok=True)
    if not (nic / "device").is_symlink():
        (nic / "device").symlink_to(Path("..", "..", "..", "devices", "pci0000:00", "0000:5e:00.0"))
    proc = root / "proc"
    if not proc.exists():
        proc.symlink_to("/proc")  # processes and host metrics are the real ones of this host
    kernel_log(cluster_dir, machine).parent.mkdir(parents=True, exist_ok=True)
    kernel_log(cluster_dir, machine).touch()
    return root


def _kernel_line(cluster_dir: Path, machine: str, text: str) -> None:
    stamp = datetime.now(tz=UTC).strftime("%b %d %H:%M:%S")
    uptime = time.monotonic()
    with open(kernel_log(cluster_dir, machine), "a", encoding="utf-8") as fh:
        fh.write(f"{stamp} {machine} kernel: [{uptime:12.6f}] {text}\n")


def _set_nic(cluster_dir: Path, machine: str, up: bool) -> None:
    nic = machine_root(cluster_dir, machine) / "sys" / "class" / "net" / NIC
    changes = int((nic / "carrier_changes").read_text().strip() or 0) + 1
    (nic / "operstate").write_text(("up" if up else "down") + "\n")
    (nic / "carrier").write_text(("1" if up else "0") + "\n")
    (nic / "carrier_changes").write_text(f"{changes}\n")


def push_buggy_code(settings: Settings, cluster_dir: Path, job: str, version: str = "v2-buggy") -> str:
    """A bad code push, the way operators push code: an urgent code update through the action
    service (which records it, so a rollback knows where to go back to)."""
    from trainguard.actions.plans import CodeUpdate
    from trainguard.infra.bus import EventProducer, signer_for
    from trainguard.schemas.base import now_ms
    from trainguard.schemas.control import stable_id
    from trainguard.schemas.topics import DECISIONS
    from trainguard_demo import codever

    previous = codever.current_version(cluster_dir)
    ts = now_ms()
    decision = CodeUpdate(version, urgent=True, previous=previous).decision(
        job, stable_id("code-update", job, version, ts), ts
    )
    producer = EventProducer(settings.kafka, signer=signer_for(settings, "operator"))
    try:
        producer.send(decision, DECISIONS).get(timeout=30)
    finally:
        producer.close()
    return f"urgent code update {previous} -> {version} pushed for {job}"


def inject(
    cluster_dir: Path, machine: str, kind: str, job: str = "", xid: int = 79, settings: Settings | None = None
) -> str:
    """Inject ``kind`` on ``machine``; returns a short description of what was done.

    ``user-error`` with ``settings`` is a code push through the action service (the realistic
    path); without them the machine's code version is switched directly.
    """
    if kind == "user-error" and settings is not None:
        return push_buggy_code(settings, cluster_dir, job)
    if kind == "xid":
        _kernel_line(
            cluster_dir,
            machine,
            f"NVRM: Xid (PCI:0000:3b:00): {xid}, pid=4242, name=python, GPU has fallen off the bus.",
        )
        return f"Xid {xid} line in {machine}'s kernel log"
    if kind == "gpu-lost":
        _kernel_line(cluster_dir, machine, "NVRM: GPU at PCI:0000:5e:00: GPU has fallen off the bus.")
        _mark_diagnostics(cluster_dir, machine, perturb=True)
        return f"GPU lost on {machine}"
    if kind == "nic-down":
        _set_nic(cluster_dir, machine, up=False)
        return f"{NIC} down on {machine} (stays down)"
    if kind == "nic-flap":

        def flap() -> None:  # one short down/up: a transient flap, to be tolerated (a second
            # one within the NIC rules' window would make the machine an eviction candidate)
            _set_nic(cluster_dir, machine, up=False)
            time.sleep(1.0)
            _set_nic(cluster_dir, machine, up=True)

        threading.Thread(target=flap, daemon=True).start()
        return f"{NIC} flapped (down 1 s) on {machine}"
    if kind == "machine-freeze":
        frozen = freeze_machine(cluster_dir, machine)
        threading.Timer(FREEZE_S, thaw, args=(frozen,)).start()
        return (
            f"{machine} frozen: {len(frozen)} processes stopped (its exporter and ranks) for {FREEZE_S:.0f} s"
        )
    if kind in faults.KINDS:
        persistent = kind in ("slow",)
        f = faults.inject_fault(cluster_dir, machine, kind, job=job, persistent=persistent)
        return f"{kind} on {machine} (fault {f.id})"
    raise ValueError(f"unknown fault {kind!r}; known: {', '.join(ALL_FAULTS)}")


def _machine_processes(cluster_dir: Path, machine: str) -> list[tuple[int, str]]:
    """(pid, start time) of every process of ``machine`` of this cluster: its exporter
    (``--node``), its ranks and warm processes (``--machine``) and their children (a forked
    DataLoader worker keeps its parent's command line)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            start = (entry / "stat").read_text().rsplit(")", 1)[1].split()[19]
        except (OSError, IndexError):
            continue
        # A warm process that became a rank set its title (setproctitle): one string, spaces.
        args = b" ".join(argv).decode(errors="replace").split()
        ours = any(str(cluster_dir) in a for a in args)
        named = any(a in ("--node", "--machine") and b == machine for a, b in itertools.pairwise(args))
        if ours and named:
            out.append((int(entry.name), start))
    return out


def freeze_machine(cluster_dir: Path, machine: str) -> list[tuple[int, str]]:
    """SIGSTOP every process of ``machine``; returns what was stopped (for :func:`thaw`)."""
    frozen = _machine_processes(cluster_dir, machine)
    for pid, _ in frozen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGSTOP)
    return frozen


def thaw(frozen: list[tuple[int, str]]) -> None:
    """SIGCONT what :func:`freeze_machine` stopped and still runs (the same process: its start time)."""
    for pid, start in frozen:
        try:
            now = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19]
        except (OSError, IndexError):
            continue
        if now == start:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGCONT)


def _mark_diagnostics(cluster_dir: Path, machine: str, **flags: bool) -> None:
    """Make the machine fail stop-time diagnostics too (a broken GPU fails the alignment test)."""
    path = cluster_dir / "machines" / machine / "diagnostics.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(flags))
