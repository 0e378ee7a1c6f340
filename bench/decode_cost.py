"""Decode cost per message type: how long ``trainguard.schemas.codec.decode`` takes for what a worker reads.

    .venv/bin/python bench/decode_cost.py [--n 20000] [--repeat 3]

The messages are those of ``bench/stream_load.py`` (one node's GPU batch of 8 GPUs, host sample,
NIC batch, exporter heartbeat, a training step), encoded once and decoded ``--n`` times each;
the best of ``--repeat`` rounds is printed in microseconds per message, and the mix a worker
sees per machine (GPU and host every 10 s, NIC every 30 s, heartbeat every 5 s, 8 ranks'
steps every 10 s) weighted into one figure.  No broker: decoding alone, on one core.
"""

from __future__ import annotations

import argparse
import time

from trainguard.schemas.base import Event
from trainguard.schemas.codec import decode, encode
from trainguard.schemas.telemetry import (
    DiskUsage,
    GpuSample,
    GpuSampleBatch,
    Heartbeat,
    HostSample,
    NicSample,
    NicSampleBatch,
    SourceHealth,
)
from trainguard.schemas.workload import TrainingStep

TS = 1_795_000_000_000


def gpu_samples() -> list[GpuSample]:
    """One healthy node's 8 GPUs (also what ``bench/stream_load.py`` sends)."""
    return [
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


def messages() -> dict[str, tuple[Event, float]]:
    """name -> (event, messages of this kind per machine per second)."""
    gpus = gpu_samples()
    host = HostSample(
        node="n1",
        ts_ms=TS,
        cpu_util_pct=40.0,
        load1=8,
        load5=8,
        load15=8,
        mem_total_bytes=2 << 40,
        mem_available_bytes=1 << 40,
        disks=[DiskUsage("/", 10**12, 10**11)],
        job="j",
    )
    nic = NicSample(name="ib0", kind="ib", operstate="up", carrier=True)
    beat = Heartbeat(
        node="n1", component="exporter", ts_ms=TS, job="j", sources=[SourceHealth("nvml", True, TS)]
    )
    step = TrainingStep(
        job="j", rank=3, step=100, ts_ms=TS, loss=2.5, grad_norm=1.0, step_time_s=0.4, node="n1"
    )
    return {
        "gpu batch (8 GPUs)": (GpuSampleBatch(node="n1", ts_ms=TS, gpus=gpus, job="j"), 1 / 10),
        "host sample": (host, 1 / 10),
        "nic batch": (NicSampleBatch(node="n1", ts_ms=TS, job="j", nics=[nic]), 1 / 30),
        "heartbeat": (beat, 1 / 5),
        "training step": (step, 8 / 10),
    }


def cost_us(raw: bytes, n: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            decode(raw)
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    weighted = total_rate = 0.0
    for name, (event, rate) in messages().items():
        us = cost_us(encode(event), args.n, args.repeat)
        weighted += us * rate
        total_rate += rate
        print(f"{name:<20}{us:8.1f} us/message")
    print(f"{'mix per machine':<20}{weighted / total_rate:8.1f} us/message (weighted by rate)")


if __name__ == "__main__":
    main()
