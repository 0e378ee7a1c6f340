"""Exporter CPU and memory at the default intervals (GPU 10 s, NIC 30 s, host 10 s, heartbeat 5 s)
with 8 simulated GPUs, reading this machine's real /proc, /sys and /dev/kmsg, delivering to the
local Kafka broker (``trainguard stack up``) or, with ``--no-kafka``, only spooling.

    .venv/bin/python bench/exporter_bench.py [--duration 60] [--gpus 8] [--no-kafka]

Prints CPU seconds used by the whole exporter process (all threads) over the run, CPU% of one
core, RSS at the end and peak RSS, and each source's mean round duration.

    .venv/bin/python bench/exporter_bench.py --spool [--spool-dir DIR] [--spool-seconds 4]

measures only the spool's cost of durability instead: appends/s and p50/p99/max latency of one
``Spool.append`` (a 600-byte record, default 1 MiB segments, sealed and so fsynced when full) with
fsync off, at the default interval and on every append.  Put ``--spool-dir`` on the disk the
exporter's state_dir will use: on tmpfs an fsync costs nothing.

stderr counts the ``--duration`` down (``TRAINGUARD_PROGRESS=0``: not); stdout holds the figures.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainguard_demo.nvml_sim import SimulatedNvml

from trainguard.infra.config import load_settings
from trainguard.infra.progress import Progress
from trainguard.streams.exporter.config import load_exporter_config
from trainguard.streams.exporter.service import ExporterService
from trainguard.streams.exporter.spool import Record, Spool

#: (label, fsync_interval_s) -- None is the spool before fsync existed.
SPOOL_MODES = [("off", None), ("default 1 s", 1.0), ("every append", 0.0)]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def fs_type(path: Path) -> str:
    """File system type of ``path`` (longest matching mount point in /proc/mounts)."""
    best, kind = "", "?"
    for line in Path("/proc/mounts").read_text().splitlines():
        _dev, mount, fstype, *_ = line.split()
        if str(path).startswith(mount) and len(mount) > len(best):
            best, kind = mount, fstype
    return kind


def spool_bench(base: Path, seconds: float, max_appends: int = 50_000) -> None:
    rec = Record("trainguard.telemetry.gpu", b"bench-node", b"x" * 600)
    print(f"spool append, 600-byte records, {fs_type(base.resolve())} at {base}, <= {seconds:g} s per mode")
    for label, interval in SPOOL_MODES:
        directory = Path(tempfile.mkdtemp(prefix="spool-", dir=base))
        spool = Spool(directory, max_bytes=1 << 40, fsync_interval_s=interval)
        lat: list[int] = []
        t0 = time.perf_counter()
        stop = t0 + seconds
        while len(lat) < max_appends and time.perf_counter() < stop:
            a = time.perf_counter_ns()
            spool.append(rec)
            lat.append(time.perf_counter_ns() - a)
        elapsed = time.perf_counter() - t0
        spool.close()
        shutil.rmtree(directory)
        lat.sort()
        p50, p99 = lat[len(lat) // 2] / 1000, lat[int(len(lat) * 0.99)] / 1000
        # max: the append that filled a segment and so paid for sealing (fsyncing) it
        print(
            f"  fsync {label:<13} {len(lat) / elapsed:>9,.0f} appends/s  p50 {p50:7.1f} us"
            f"  p99 {p99:7.1f} us  max {lat[-1] / 1000:8.1f} us  ({len(lat)} appends)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--no-kafka", action="store_true", help="spool only (no delivery thread)")
    ap.add_argument("--spool", action="store_true", help="only the spool append/fsync benchmark")
    ap.add_argument("--spool-dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--spool-seconds", type=float, default=4.0, help="per fsync mode")
    args = ap.parse_args()
    if args.spool:
        os.makedirs(args.spool_dir, exist_ok=True)
        spool_bench(args.spool_dir, args.spool_seconds)
        return
    state = Path(tempfile.mkdtemp(prefix="exporter-bench-"))
    cfg = load_exporter_config(
        {
            "node": "bench-node",
            "job": "bench",
            "state_dir": str(state),
            "kernel_log": {"start_at": "end"},
            "reporter": {"socket": str(state / "reporter.sock")},
            "process": {"cmd_pattern": "train\\.py"},
            "commands": {"enabled": not args.no_kafka},
        },
        environ={},
    )
    service = ExporterService(cfg, load_settings().kafka, nvml=SimulatedNvml(args.gpus))
    rss0 = rss_mb()
    c0, t0 = cpu_s(), time.monotonic()
    if args.no_kafka:
        service.exporter.start()
    else:
        service.start()
    # The seconds counted down on stderr, from this thread every 5 s (no ticking thread: this
    # process's CPU is what is measured, and a dozen updates cost microseconds of it).
    with Progress("exporter bench", total=args.duration, unit="s", rate=False, summary=False) as bar:
        while (left := t0 + args.duration - time.monotonic()) > 0:
            time.sleep(min(5.0, left))
            bar.update(int(time.monotonic() - t0))
    c1, t1 = cpu_s(), time.monotonic()
    rss1 = rss_mb()
    health = {h.name: h for h in service.exporter.health()}
    rounds = {name: service.exporter._health[name].rounds for name in service.exporter.sources}
    if args.no_kafka:
        service.exporter.stop()
    else:
        service.stop()
    used = c1 - c0
    print(f"duration {t1 - t0:.1f} s, {args.gpus} simulated GPUs, kafka={'no' if args.no_kafka else 'yes'}")
    print(f"cpu {used:.3f} s = {100 * used / (t1 - t0):.3f}% of one core")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"rss start {rss0:.1f} MiB, end {rss1:.1f} MiB, peak {peak:.1f} MiB")
    print(f"events spooled {service.spool.appended}, delivered {service.delivery.delivered}")
    for name in service.exporter.sources:
        h = health[name]
        print(f"  {name:<11} rounds {rounds[name]:>4}  last round {h.duration_ms:8.3f} ms  ok={h.ok}")


if __name__ == "__main__":
    main()
