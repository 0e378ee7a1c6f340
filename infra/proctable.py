"""The one reader of the process table: a pid's ``stat`` (state, parent, start time, name),
command line and environment, from a procfs directory.

Every part of TrainGuard that looks at processes reads through :class:`ProcTable`: the stack
manager (are our servers alive?), the node exporter's process source and stack capture (the
training process trees), the action service's executors (ranks, pools, zygotes).  :data:`LIVE`
is the table of this host (``/proc``); the exporter builds one on its configured root
(``<root>/proc``), which is how its tests read fixture trees and how a simulated node reads the
host's processes through its own system tree.

Why not psutil: psutil is the well-kept choice for a live system, but its procfs directory is
the process-wide global ``psutil.PROCFS_PATH`` (read by every call), so two exporters with
different roots in one process -- or a test reading a fixture tree while the stack manager looks
at the live one -- would race on it; ``psutil.pid_exists`` asks the live kernel (``os.kill``)
whatever the root; and the exporter needs a zombie's wait status (``stat`` field 52), which
psutil does not expose (it raises ``ZombieProcess`` instead).  Using psutil for the live system
and a reader of our own for rooted trees would make two implementations of "read a pid's state"
that can disagree (a zombie, a half-exec'd process), so there is one small reader, and the live
system is the root ``/proc``.  Linux only, like the rest of the exporter.

A vanished process (it exited between listing and reading) is not an error: readers return
``None`` / ``""`` / ``[]`` and :meth:`ProcTable.stats` skips it.

>>> s = parse_stat("4242 (python (x)) Z 4200 4242 4200 0 -1 4194560 " + "0 " * 42 + "256")
>>> (s.pid, s.comm, s.state, s.ppid, s.exit_status, s.alive)
(4242, 'python (x)', 'Z', 4200, 256, False)
>>> LIVE.alive(os.getpid()), LIVE.ppid(os.getpid()) == os.getppid()
(True, True)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: stat states of a process that has exited: a zombie (not yet reaped) and dead (being reaped).
DEAD_STATES = frozenset({"Z", "X"})
#: states of a stopped process: job-control stop (SIGSTOP) and tracing stop.  It holds its stacks
#: still but runs no code of its own (no Flight Recorder dump, no reporter datagram).
STOPPED_STATES = frozenset({"T", "t"})
#: the state of a job-control stop alone (SIGSTOP, a scheduler's suspend): it lasts until a
#: SIGCONT.  A tracing stop (``t``) is often a moment: py-spy pauses a rank for every blocking dump
#: (measured: a busy Python loop read ``t`` 616 of 4,925 looks during five ``py-spy dump`` runs).
JOB_CONTROL_STOP = "T"


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/PID/stat`` TrainGuard uses."""

    pid: int
    comm: str
    state: str
    ppid: int
    #: clock ticks after boot: (pid, starttime) names a process even when its pid is reused.
    starttime: int
    #: the wait status of a zombie (Linux >= 3.5 exposes it), else None.
    exit_status: int | None = None

    @property
    def alive(self) -> bool:
        """Still running: a zombie, dead but not yet reaped by its parent, is not."""
        return self.state not in DEAD_STATES


def parse_stat(text: str) -> ProcStat:
    """``/proc/PID/stat``; the name may hold spaces and parentheses, so split at the last ``)``."""
    head, _, rest = text.rpartition(")")
    pid_text, _, comm = head.partition(" (")
    fields = rest.split()
    if len(fields) < 20:
        raise ValueError(f"truncated stat line: {text[:80]!r}")
    exit_status = int(fields[49]) if len(fields) > 49 and fields[0] == "Z" else None
    return ProcStat(
        pid=int(pid_text),
        comm=comm,
        state=fields[0],
        ppid=int(fields[1]),
        starttime=int(fields[19]),
        exit_status=exit_status,
    )


def parse_signal_masks(status: str) -> dict[str, int]:
    """The SigCgt, SigIgn and SigBlk masks of a ``/proc/PID/status`` text (hex, bit N-1 = signal N).

    >>> parse_signal_masks("SigBlk:\\t0000000000000000\\nSigIgn:\\t0000001000\\nSigCgt:\\t00004002\\n")
    {'SigBlk': 0, 'SigIgn': 4096, 'SigCgt': 16386}
    """
    out = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("SigCgt", "SigIgn", "SigBlk"):
            try:
                out[key] = int(value.strip(), 16)
            except ValueError:
                continue
    return out


def parse_environ(raw: bytes) -> dict[str, str]:
    """``/proc/PID/environ`` (NUL-separated ``K=V``).

    >>> parse_environ(b"RANK=3\\x00WORLD_SIZE=8\\x00junk\\x00")
    {'RANK': '3', 'WORLD_SIZE': '8'}
    """
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return out


class ProcTable:
    """The processes of one procfs directory (``/proc`` for this host)."""

    def __init__(self, proc: str | os.PathLike[str] = "/proc") -> None:
        self.proc = Path(proc)

    def __repr__(self) -> str:
        return f"ProcTable({str(self.proc)!r})"

    def _read(self, pid: int, name: str) -> bytes:
        with open(self.proc / str(pid) / name, "rb") as fh:
            return fh.read()

    def pids(self) -> list[int]:
        """Every pid listed right now (some may be gone by the time they are read)."""
        try:
            names = os.listdir(self.proc)
        except OSError:
            return []
        return [int(n) for n in names if n.isdigit()]

    def exists(self, pid: int) -> bool:
        """The pid has an entry (running, a zombie, or mid-exec with an empty command line)."""
        return pid > 0 and (self.proc / str(pid)).exists()

    def stat(self, pid: int) -> ProcStat | None:
        """The pid's ``stat``, or None when it is gone (or its stat line is garbled)."""
        if pid <= 0:
            return None
        try:
            return parse_stat(self._read(pid, "stat").decode("utf-8", "replace").strip())
        except (OSError, ValueError):
            return None

    def stats(self) -> dict[int, ProcStat]:
        """Every readable ``stat`` by pid; vanished or garbled processes are skipped."""
        out = {}
        for pid in self.pids():
            st = self.stat(pid)
            if st is not None:
                out[pid] = st
        return out

    def alive(self, pid: int) -> bool:
        """True while ``pid`` runs (a zombie, dead but not yet reaped by its parent, is not)."""
        st = self.stat(pid)
        return st is not None and st.alive

    def ppid(self, pid: int) -> int:
        """The parent pid, 0 when unknown (gone)."""
        st = self.stat(pid)
        return st.ppid if st is not None else 0

    def _cmdline_raw(self, pid: int) -> str:
        try:
            return self._read(pid, "cmdline").decode("utf-8", "replace")
        except OSError:
            return ""

    def argv(self, pid: int) -> list[str]:
        """The command line as arguments ([] when gone, a zombie, or a kernel thread).

        A process renamed with setproctitle may show its whole title as one argument.
        """
        return [a for a in self._cmdline_raw(pid).split("\0") if a]

    def cmdline(self, pid: int) -> str:
        """The command line as one string, NULs turned into spaces ("" when gone)."""
        return self._cmdline_raw(pid).replace("\0", " ").strip()

    def takes_default(self, pid: int, sig: int) -> bool:
        """True when ``sig`` would act on ``pid`` by its default action: not caught by a handler,
        not ignored, not blocked by its main thread (``/proc/PID/status`` SigCgt/SigIgn/SigBlk).
        For SIGTERM that means a sent signal is fatal: the process runs no more of its own code,
        even while the kernel has yet to schedule its exit.  False when gone or unreadable."""
        try:
            text = self._read(pid, "status").decode("ascii", "replace")
        except OSError:
            return False
        masks = parse_signal_masks(text)
        bit = 1 << (sig - 1)
        return len(masks) == 3 and not any(masks[k] & bit for k in ("SigCgt", "SigIgn", "SigBlk"))

    def environ(self, pid: int) -> dict[str, str] | None:
        """The environment it started with, or None when it is not ours to read (or gone)."""
        try:
            return parse_environ(self._read(pid, "environ"))
        except OSError:
            return None


#: this host's process table.
LIVE = ProcTable("/proc")
