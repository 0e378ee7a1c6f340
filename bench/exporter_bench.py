"""Exporter CPU and memory at the default intervals (GPU 10 s, NIC 30 s, host 10 s, heartbeat 5 s)
with 8 simulated GPUs, reading this machine's real /proc, /sys and /dev/kmsg, delivering to the
local Kafka broker (``trainguard stack up``) or, with ``--no-kafka``, only spooling.

    .venv/bin/python bench/exporter_bench.py [--duration 60] [--gpus 8] [--no-kafka]

Prints CPU seconds used by the whole exporter process (all threads) over the run, CPU% of one
core, RSS at the end and peak RSS, and each source's mean round duration.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainguard_demo.nvml_sim import SimulatedNvml

from infra.config import load_settings
from streams.exporter.config import load_exporter_config
from streams.exporter.service import ExporterService


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--no-kafka", action="store_true", help="spool only (no delivery thread)")
    args = ap.parse_args()
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
    time.sleep(args.duration)
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
