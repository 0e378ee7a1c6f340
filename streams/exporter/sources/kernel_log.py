"""``kernel_log`` source: follows ``/dev/kmsg`` or a kernel log file and publishes the lines that
matter -- every line a log row of the rule table matches, plus NVRM/Xid, OOM killer, I/O and
filesystem errors, panics/BUG/lockups (the paper's host inspection item: Xid in dmesg, 2 s to
detect an OS kernel fault, Table 3).

No line lost, none sent twice after a restart: the position (kmsg sequence number and boot id, or
file inode + byte offset + line counter) is saved only after the runner has spooled the round's
events (:meth:`KernelLogSource.commit`).  Rotation (rename + new file, or copytruncate) is
followed: the old file is read to its end before switching.  Garbage lines are skipped quietly.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trainguard.detectors.rule_table import RuleTable, default_rule_table, load_rule_table
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.workload import LogLine
from trainguard.streams.exporter.sources.base import SourceContext, read_text, register

log = logging.getLogger(__name__)

#: category -> pattern; first match wins (order matters: an NVRM OOM-ish line is still "xid").
CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("xid", re.compile(r"NVRM: Xid \(")),
    ("nvrm", re.compile(r"NVRM: |nvidia-modeset: ERROR|nvidia-nvswitch\d*: .*(error|fatal)", re.I)),
    (
        "oom",
        re.compile(
            r"Out of memory: Kill|invoked oom-killer|Memory cgroup out of memory|oom-kill:|oom_reaper: reaped"
        ),
    ),
    (
        "panic",
        re.compile(
            r"Kernel panic|\bBUG: |\bOops\b|general protection fault|soft lockup|hard LOCKUP|"
            r"blocked for more than \d+ seconds|Call Trace:|RIP: |"
            r"Machine check events logged|mce: \[Hardware Error\]"
        ),
    ),
    (
        "fs_error",
        re.compile(
            r"EXT4-fs (error|warning)|XFS \(.*\): .*(error|Corruption|Shutting down)|"
            r"Remounting filesystem read-only|BTRFS (error|critical)|nfs: server .* not responding|"
            r"LustreError|Lustre: .* (lost|evicted)|beegfs.*error|fuse: .*error",
            re.I,
        ),
    ),
    (
        "io_error",
        re.compile(
            r"I/O error|blk_update_request|critical medium error|Medium Error|"
            r"nvme\d+n?\d*: .*(timeout|I/O|reset|failed)|ata\d+.*(failed|error)|SCSI error|"
            r"task abort|device offline error",
            re.I,
        ),
    ),
)


def shipped(text: str, table: RuleTable) -> bool:
    """Whether the exporter publishes a kernel line: one of :data:`CATEGORIES`, or one a log row
    of ``table`` matches (``ib0: Link down``, ``NETDEV WATCHDOG``, mlx5 health errors...) -- the
    rule table decides what matters, the categories only add what no row names yet.

    >>> shipped("[ 5521.1] mlx5_core 0000:5e:00.0 ib0: Link down", default_rule_table())
    True
    >>> shipped("usb 1-1: new high-speed USB device number 2", default_rule_table())
    False
    """
    # Not the traceback rows: they judge a Python traceback's last line (one is a catch-all for
    # any exception), which a kernel log never holds.  The kernel_trace rows (a call-trace frame
    # in a shared filesystem) are shipped too: the worker reads them after a hung task's line.
    return (
        classify_kernel_line(text) is not None
        or table.match_line(text) is not None
        or table.match_line(text, in_kernel_trace=True) is not None
    )


def classify_kernel_line(text: str) -> str | None:
    """The category of a kernel log line, or None when it is not one the exporter publishes.

    >>> classify_kernel_line("[ 8123.4] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU fell")
    'xid'
    >>> classify_kernel_line("Out of memory: Killed process 4242 (python) total-vm:8kB")
    'oom'
    >>> classify_kernel_line("usb 1-1: new high-speed USB device number 2") is None
    True
    """
    for category, pattern in CATEGORIES:
        if pattern.search(text):
            return category
    return None


@dataclass(frozen=True)
class KmsgRecord:
    seq: int
    ts_usec: int
    level: int
    message: str

    def as_dmesg(self) -> str:
        """The record as ``dmesg`` prints it, so detectors parse kmsg and file lines alike."""
        return f"[{self.ts_usec // 1_000_000:5d}.{self.ts_usec % 1_000_000:06d}] {self.message}"


def parse_kmsg_record(raw: str) -> KmsgRecord | None:
    """One ``/dev/kmsg`` record (``prio,seq,ts_usec,flags[,...];message``); None for garbage.

    Continuation lines (`` KEY=value`` dictionary) are dropped; the message is the first line.

    >>> parse_kmsg_record("3,1523,81234567,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU fell off\\n SUBSYSTEM=pci")
    KmsgRecord(seq=1523, ts_usec=81234567, level=3, message='NVRM: Xid (PCI:0000:3b:00): 79, GPU fell off')
    >>> parse_kmsg_record("not a record") is None
    True
    """
    head, sep, body = raw.partition(";")
    if not sep:
        return None
    fields = head.split(",")
    if len(fields) < 3:
        return None
    try:
        prio, seq, ts = int(fields[0]), int(fields[1]), int(fields[2])
    except ValueError:
        return None
    if seq < 0 or ts < 0:
        return None
    return KmsgRecord(seq=seq, ts_usec=ts, level=prio & 7, message=body.split("\n", 1)[0].rstrip("\r"))


class _Follower(Protocol):
    """Reads new lines of one kernel log (a file or /dev/kmsg) as (seq, text)."""

    def read(self, limit: int) -> list[tuple[int, str]]: ...

    def position(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class KmsgFollower:
    """``/dev/kmsg``: one record per read(); EAGAIN = nothing new; EPIPE = ring buffer overran."""

    def __init__(self, path: Path, saved: dict[str, Any], boot_id: str, start_at: str) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self.boot_id = boot_id
        # Sequence numbers restart at boot: a saved position from another boot is meaningless.
        same_boot = saved.get("boot_id") == boot_id and saved.get("kind") == "kmsg"
        self.last_seq: int = int(saved.get("seq", -1)) if same_boot else -1
        if not same_boot and start_at == "end":
            os.lseek(self.fd, 0, os.SEEK_END)
        self.overruns = 0

    def read(self, limit: int) -> list[tuple[int, str]]:
        out: list[tuple[int, str]] = []
        while len(out) < limit:
            try:
                raw = os.read(self.fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten before we read them
                    self.overruns += 1
                    continue
                raise
            if not raw:
                break
            rec = parse_kmsg_record(raw.decode("utf-8", "replace"))
            if rec is None or rec.seq <= self.last_seq:
                continue
            self.last_seq = rec.seq
            out.append((rec.seq, rec.as_dmesg()))
        return out

    def position(self) -> dict[str, Any]:
        return {"kind": "kmsg", "boot_id": self.boot_id, "seq": self.last_seq}

    def close(self) -> None:
        os.close(self.fd)


class FileFollower:
    """A growing text file; follows rename-rotation (old file read to its end) and truncation."""

    def __init__(self, path: Path, saved: dict[str, Any], start_at: str) -> None:
        self.path = path
        self.seq = int(saved.get("seq", 0))
        self.fh: Any = None
        self.inode = -1
        self.offset = 0
        self.pending = b""
        saved_inode = saved.get("inode")
        if saved.get("kind") == "file" and saved_inode is not None:
            self._resume(int(saved_inode), int(saved.get("offset", 0)))
        else:
            self._open(end=start_at == "end")

    def _open(self, end: bool = False, offset: int = 0) -> None:
        self.fh = open(self.path, "rb")  # noqa: SIM115  (held open across rounds to follow rotation)
        st = os.fstat(self.fh.fileno())
        self.inode = st.st_ino
        self.offset = st.st_size if end else (offset if offset <= st.st_size else 0)
        self.fh.seek(self.offset)
        self.pending = b""

    def _resume(self, inode: int, offset: int) -> None:
        try:
            if os.stat(self.path).st_ino == inode:
                self._open(offset=offset)
                return
        except FileNotFoundError:
            pass
        # Rotated while we were down: finish the old file (path.1, path-2024..., same dir) first.
        for sibling in sorted(self.path.parent.glob(self.path.name + "*")):
            try:
                if sibling != self.path and os.stat(sibling).st_ino == inode:
                    self.fh = open(sibling, "rb")  # noqa: SIM115  (closed when switching files)
                    self.inode, self.offset = inode, offset
                    self.fh.seek(offset)
                    return
            except OSError:
                continue
        log.warning(
            "kernel log %s rotated away while stopped; lines after offset %d are lost", self.path, offset
        )
        self._open()

    def _read_lines(self, limit: int) -> list[tuple[int, str]]:
        out: list[tuple[int, str]] = []
        while len(out) < limit:
            raw = self.fh.readline()
            if not raw:
                break
            if not raw.endswith(b"\n"):  # a line still being written: wait for its end
                self.pending += raw
                break
            raw, self.pending = self.pending + raw, b""
            self.offset += len(raw)
            self.seq += 1
            out.append((self.seq, raw.decode("utf-8", "replace").rstrip("\r\n")))
        if self.pending:
            self.fh.seek(self.offset)  # re-read the partial line whole next time
            self.pending = b""
        return out

    def read(self, limit: int) -> list[tuple[int, str]]:
        out = self._read_lines(limit)
        if len(out) >= limit:
            return out
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return out  # between rename and create: the old file stays open
        if st.st_ino != self.inode:
            self.fh.close()
            self._open()
            out += self._read_lines(limit - len(out))
        elif st.st_size < self.offset:  # copytruncate
            self.fh.seek(0)
            self.offset = 0
            out += self._read_lines(limit - len(out))
        return out

    def position(self) -> dict[str, Any]:
        return {
            "kind": "file",
            "path": str(self.path),
            "inode": self.inode,
            "offset": self.offset,
            "seq": self.seq,
        }

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()


class KernelLogSource:
    name = "kernel_log"

    def __init__(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg.kernel_log
        self.path = Path(self.cfg.path) if self.cfg.path else ctx.cfg.sys_path("/dev/kmsg")
        self.pos_file = None if ctx.once or ctx.state_dir is None else ctx.state_dir / "kernel_log.pos.json"
        self.follower: _Follower | None = None
        self._uncommitted: dict[str, Any] | None = None
        self.rules = load_rule_table(self.cfg.rules) if self.cfg.rules else default_rule_table()

    def _saved(self) -> dict[str, Any]:
        if self.pos_file is None or not self.pos_file.exists():
            return {}
        try:
            data = json.loads(self.pos_file.read_text())
        except (OSError, ValueError):
            log.warning("unreadable kernel log position %s; starting over", self.pos_file)
            return {}
        return data if isinstance(data, dict) and data.get("source") == str(self.path) else {}

    def _follower(self) -> _Follower:
        if self.follower is None:
            saved = self._saved()
            if stat.S_ISCHR(os.stat(self.path).st_mode):
                try:
                    boot_id = read_text(self.ctx.cfg.sys_path("/proc/sys/kernel/random/boot_id"))
                except OSError:
                    boot_id = ""
                self.follower = KmsgFollower(self.path, saved, boot_id, self.cfg.start_at)
            else:
                self.follower = FileFollower(self.path, saved, self.cfg.start_at)
        return self.follower

    def collect(self) -> list[Event]:
        follower = self._follower()
        lines = follower.read(self.cfg.max_lines_per_round)
        ts = now_ms()
        events: list[Event] = []
        for seq, text in lines:
            if not text.strip() or not (self.cfg.all_lines or shipped(text, self.rules)):
                continue
            events.append(
                LogLine(
                    node=self.ctx.node,
                    ts_ms=ts,
                    source="kernel",
                    line=text[:65_536],
                    seq=seq,
                    job=self.ctx.job,
                )
            )
        self._uncommitted = {"source": str(self.path), **follower.position()}
        return events

    def commit(self) -> None:
        """Persist the position once the round's events are spooled (atomic rename)."""
        if self.pos_file is None or self._uncommitted is None:
            return
        tmp = self.pos_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._uncommitted))
        os.replace(tmp, self.pos_file)

    def close(self) -> None:
        if self.follower is not None:
            self.follower.close()
            self.follower = None


@register("kernel_log")
def _factory(ctx: SourceContext) -> KernelLogSource:
    return KernelLogSource(ctx)
