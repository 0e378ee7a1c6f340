"""``host`` source: CPU utilisation and load, memory and swap, disk usage per mount, process count.

Reads ``<root>/proc/{stat,meminfo,loadavg,mounts}`` and ``statvfs`` of each real mount under
``<root>``.  CPU utilisation is the busy share of jiffies since the previous round (the first
round uses the totals since boot).  CPU overload, CPU OOM and full disks are 26% of the paper's
explicit failures (Table 1).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.telemetry import DiskUsage, HostSample
from trainguard.streams.exporter.sources.base import SourceContext, read_text, register

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuTimes:
    busy: int
    total: int


def parse_proc_stat(text: str) -> CpuTimes:
    """The aggregate ``cpu`` line of ``/proc/stat``; idle = idle + iowait.

    >>> parse_proc_stat("cpu  100 0 50 800 50 0 0 0 0 0\\ncpu0 1 2 3 4")
    CpuTimes(busy=150, total=1000)
    """
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            # guest/guest_nice (fields 9, 10) are already counted in user/nice.
            values = [int(v) for v in parts[1:9]]
            idle = values[3] + (values[4] if len(values) > 4 else 0)
            total = sum(values)
            return CpuTimes(busy=total - idle, total=total)
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def cpu_util_pct(prev: CpuTimes | None, cur: CpuTimes) -> float:
    """Busy percentage between two readings (or since boot without a previous one).

    >>> cpu_util_pct(CpuTimes(100, 1000), CpuTimes(175, 1100))
    75.0
    """
    busy, total = cur.busy, cur.total
    if prev is not None and cur.total > prev.total:
        busy, total = cur.busy - prev.busy, cur.total - prev.total
    if total <= 0:
        return 0.0
    return max(0.0, min(100.0, 100.0 * busy / total))


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` in bytes by key (``kB`` values multiplied by 1024).

    >>> parse_meminfo("MemTotal:       16384 kB\\nHugePages_Total:       0\\n")
    {'MemTotal': 16777216, 'HugePages_Total': 0}
    """
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if not parts:
            continue
        try:
            value = int(parts[0])
        except ValueError:
            continue
        out[key.strip()] = value * 1024 if len(parts) > 1 and parts[1] == "kB" else value
    return out


def parse_loadavg(text: str) -> tuple[float, float, float]:
    """The 1/5/15-minute load averages of ``/proc/loadavg``.

    >>> parse_loadavg("0.52 0.58 0.59 2/1034 12345")
    (0.52, 0.58, 0.59)
    """
    a, b, c = (float(v) for v in text.split()[:3])
    return a, b, c


def parse_mounts(text: str, skip_fs_types: set[str]) -> list[str]:
    """Mount points of real file systems in ``/proc/mounts`` (octal escapes decoded, deduplicated).

    >>> text = "/dev/sda1 / ext4 rw 0 0\\nproc /proc proc rw 0 0\\n/dev/sdb /data\\\\040x xfs rw 0 0"
    >>> parse_mounts(text, {"proc"})
    ['/', '/data x']
    """
    seen: list[str] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3 or parts[2] in skip_fs_types:
            continue
        mount = parts[1].encode().decode("unicode_escape")
        if mount not in seen:
            seen.append(mount)
    return seen


def count_processes(proc: str | os.PathLike[str]) -> int:
    return sum(1 for name in os.listdir(proc) if name.isdigit())


class HostSource:
    name = "host"

    def __init__(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        self.proc = ctx.cfg.sys_path("/proc")
        self.skip = set(ctx.cfg.host.skip_fs_types)
        self._prev: CpuTimes | None = None

    def _disks(self) -> list[DiskUsage]:
        try:
            mounts = parse_mounts(read_text(self.proc / "mounts"), self.skip)
        except OSError:
            return []
        out = []
        for mount in mounts:
            try:
                st = os.statvfs(self.ctx.cfg.sys_path(mount))
            except OSError:  # not mounted under this root, or a dead network mount
                continue
            total = st.f_blocks * st.f_frsize
            used = (st.f_blocks - st.f_bfree) * st.f_frsize
            out.append(DiskUsage(mount=mount, total_bytes=total, used_bytes=used))
        return out

    def collect(self) -> list[Event]:
        cur = parse_proc_stat(read_text(self.proc / "stat"))
        util = cpu_util_pct(self._prev, cur)
        self._prev = cur
        mem = parse_meminfo(read_text(self.proc / "meminfo"))
        l1, l5, l15 = parse_loadavg(read_text(self.proc / "loadavg"))
        total = mem.get("MemTotal", 0)
        # MemAvailable exists since Linux 3.14; older kernels: free + caches as an estimate.
        available = mem.get("MemAvailable", mem.get("MemFree", 0) + mem.get("Cached", 0))
        swap_total = mem.get("SwapTotal", 0)
        return [
            HostSample(
                node=self.ctx.node,
                ts_ms=now_ms(),
                cpu_util_pct=round(util, 2),
                load1=l1,
                load5=l5,
                load15=l15,
                mem_total_bytes=total,
                mem_available_bytes=min(available, total) if total else available,
                swap_total_bytes=swap_total,
                swap_used_bytes=max(0, swap_total - mem.get("SwapFree", swap_total)),
                process_count=count_processes(self.proc),
                disks=self._disks(),
                job=self.ctx.job,
            )
        ]

    def close(self) -> None:
        pass


@register("host")
def _factory(ctx: SourceContext) -> HostSource:
    return HostSource(ctx)
