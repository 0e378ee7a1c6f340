"""Benchmark: how many machines one stream worker (one core) keeps up with, and Xid->decision latency.

Simulates N machines x 8 GPUs at ByteRobust's default intervals (GPU and host samples every
10 s, NIC every 30 s, exporter heartbeat every 5 s) plus step telemetry of 8 ranks per machine
(one step every --step-interval seconds), against the running local stack.  A real
`trainguard worker` is started pinned to one core (taskset), consuming from "latest".  Every 2 s
an Xid 79 line for a fresh node is produced; its latency is the time until the evict decision
arrives on the decisions topic.  The worker "keeps up" when its consumer lag (from its
/metrics) stays bounded: the lag at the end is below 2 s worth of input.

    python bench/stream_load.py --machines 300,600,1200 [--seconds 60] [--step-interval 10]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from infra.config import load_settings
from schemas.base import now_ms
from schemas.codec import decode, encode
from schemas.control import Decision
from schemas.telemetry import (
    DiskUsage,
    GpuSample,
    GpuSampleBatch,
    Heartbeat,
    HostSample,
    NicSample,
    NicSampleBatch,
    SourceHealth,
)
from schemas.topics import DECISIONS, GPU, HEARTBEATS, HOST, LOGS, NIC, STEPS
from schemas.workload import LogLine, TrainingStep

XID = "[ 8123.456789] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."


def lag_of(port: int) -> float:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return float("nan")
    return sum(float(m) for m in re.findall(r"^trainguard_consumer_lag\{[^}]*\} (\S+)$", text, re.M))


def start_worker(port: int, log: Path) -> subprocess.Popen[bytes]:
    exe = str(Path(sys.executable).with_name("trainguard"))
    argv = [
        exe,
        "worker",
        "--app-id",
        f"bench-{uuid.uuid4().hex[:6]}",
        "--web-port",
        str(port),
        "--loglevel",
        "error",
    ]
    if shutil.which("taskset") and (os.cpu_count() or 1) > 1:
        argv = ["taskset", "-c", "1", *argv]
    env = {**os.environ, "TRAINGUARD__WORKER__AUTO_OFFSET_RESET": "latest"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if lag_of(port) == lag_of(port):  # not NaN: the web server answers
            time.sleep(8)  # group join + partition assignment
            return proc
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"worker did not start; see {log}")


def run(machines: int, seconds: float, step_interval: float, port: int) -> dict[str, float]:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    settings = load_settings()
    job = f"bench-{uuid.uuid4().hex[:6]}"
    nodes = [f"{job}-n{i:05d}" for i in range(machines)]
    log = Path(f"/tmp/trainguard-bench-worker-{machines}.log")
    worker = start_worker(port, log)
    producer = KafkaProducer(**settings.kafka.client_kwargs(), linger_ms=20, compression_type="gzip", acks=1)
    injected: dict[str, float] = {}
    latencies: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        c = KafkaConsumer(**settings.kafka.client_kwargs(), group_id=None)
        parts = [TopicPartition(DECISIONS.name, p) for p in range(DECISIONS.partitions)]
        c.assign(parts)
        c.seek_to_end(*parts)
        while not stop.is_set():
            for recs in c.poll(timeout_ms=200).values():
                for r in recs:
                    d = decode(r.value)
                    if isinstance(d, Decision) and d.job == job:
                        for m in d.targets.machines:
                            if m in injected:
                                latencies.append(time.time() - injected.pop(m))
        c.close()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(1)
    per_s = machines * (1 / 10 + 1 / 10 + 1 / 30 + 1 / 5 + 8 / step_interval)
    gpus = [
        GpuSample(
            index=g,
            temperature_c=60.0,
            power_w=600.0,
            util_gpu_pct=97.0,
            mem_used_bytes=60 << 30,
            mem_total_bytes=80 << 30,
            ecc_volatile_uncorrected=0,
            pcie_replay_count=0,
        )
        for g in range(8)
    ]
    t_start = time.monotonic()
    tick = 0
    lags = []
    sent = 0
    while time.monotonic() - t_start < seconds:
        t_tick = time.monotonic()
        ts = now_ms()
        for i, node in enumerate(nodes):  # spread each source over its interval, 1 s ticks
            if i % 10 == tick % 10:
                producer.send(
                    GPU.name,
                    key=node.encode(),
                    value=encode(GpuSampleBatch(node=node, ts_ms=ts, gpus=gpus, job=job)),
                )
                producer.send(
                    HOST.name,
                    key=node.encode(),
                    value=encode(
                        HostSample(
                            node=node,
                            ts_ms=ts,
                            cpu_util_pct=40.0,
                            load1=8,
                            load5=8,
                            load15=8,
                            mem_total_bytes=2 << 40,
                            mem_available_bytes=1 << 40,
                            disks=[DiskUsage("/", 10**12, 10**11)],
                            job=job,
                        )
                    ),
                )
                sent += 2
            if i % 30 == tick % 30:
                producer.send(
                    NIC.name,
                    key=node.encode(),
                    value=encode(
                        NicSampleBatch(
                            node=node,
                            ts_ms=ts,
                            job=job,
                            nics=[NicSample(name="ib0", kind="ib", operstate="up", carrier=True)],
                        )
                    ),
                )
                sent += 1
            if i % 5 == tick % 5:
                producer.send(
                    HEARTBEATS.name,
                    key=node.encode(),
                    value=encode(
                        Heartbeat(
                            node=node,
                            component="exporter",
                            ts_ms=ts,
                            job=job,
                            sources=[SourceHealth("nvml", True, ts)],
                        )
                    ),
                )
                sent += 1
            if i % int(step_interval) == tick % int(step_interval):
                for r in range(8):
                    producer.send(
                        STEPS.name,
                        key=job.encode(),
                        value=encode(
                            TrainingStep(
                                job=job,
                                rank=i * 8 + r,
                                step=tick,
                                ts_ms=ts,
                                node=node,
                                loss=2.0,
                                grad_norm=1.0,
                                step_time_s=step_interval,
                            )
                        ),
                    )
                sent += 8
        if tick % 2 == 0:
            node = f"{job}-xid{tick}"
            injected[node] = time.time()
            producer.send(
                LOGS.name,
                key=node.encode(),
                value=encode(LogLine(node=node, ts_ms=ts, source="kernel", line=XID, seq=tick, job=job)),
            )
        producer.flush()
        lags.append(lag_of(port))
        tick += 1
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t_tick)))
    time.sleep(3)
    final_lag = lag_of(port)
    stop.set()
    watcher.join(5)
    worker.terminate()
    worker.wait(20)
    producer.close()
    lat = sorted(latencies)
    return {
        "machines": machines,
        "msgs_per_s": per_s,
        "sent": sent,
        "final_lag": final_lag,
        "max_lag": max(lags) if lags else float("nan"),
        "keeps_up": float(final_lag < 2 * per_s),
        "xid_p50_s": statistics.median(lat) if lat else float("nan"),
        "xid_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan"),
        "xid_lost": len(injected),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machines", default="300,600,1200")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--step-interval", type=float, default=10)
    ap.add_argument("--web-port", type=int, default=16300)
    args = ap.parse_args()
    print("machines  input msg/s  keeps_up  final_lag  max_lag  xid->decision p50   p99   (not decided)")
    for n in [int(x) for x in args.machines.split(",")]:
        r = run(n, args.seconds, args.step_interval, args.web_port)
        print(
            f"{n:8d}  {r['msgs_per_s']:11.0f}  {'yes' if r['keeps_up'] else 'NO':8}  {r['final_lag']:9.0f}  "
            f"{r['max_lag']:7.0f}  {r['xid_p50_s']:17.2f}s {r['xid_p99_s']:5.2f}s  {r['xid_lost']:d}",
            flush=True,
        )


if __name__ == "__main__":
    main()
