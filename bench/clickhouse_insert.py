"""Benchmark: ClickHouse insert rows/s through the store (the sink's path) on the embedded server.

Inserts GPU samples (8 GPUs per batch event -> 8 rows) and training steps in batches, from events
(flattening included) into a scratch database that is dropped afterwards.  `--chdb` also runs the
same on chDB (modern engine, in-process) for comparison.

    python bench/clickhouse_insert.py [--rows 400000] [--batch 50000] [--chdb]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from dataclasses import replace

from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.config import load_settings
from trainguard.schemas.base import Event
from trainguard.schemas.telemetry import GpuSample, GpuSampleBatch
from trainguard.schemas.workload import TrainingStep


def gpu_events(rows: int, t0: int) -> list[Event]:
    return [
        GpuSampleBatch(
            node=f"node{i % 1200}",
            ts_ms=t0 + i,
            gpus=[
                GpuSample(
                    index=g,
                    temperature_c=60.0,
                    power_w=600.0,
                    util_gpu_pct=98.0,
                    ecc_volatile_uncorrected=0,
                    pcie_replay_count=0,
                    throttle_reasons=[],
                )
                for g in range(8)
            ],
        )
        for i in range(rows // 8)
    ]


def step_events(rows: int, t0: int) -> list[Event]:
    return [
        TrainingStep(
            job="bench",
            rank=i % 9600,
            step=i // 9600,
            ts_ms=t0 + i,
            loss=2.0,
            grad_norm=1.0,
            step_time_s=1.0,
            tokens=4096,
        )
        for i in range(rows)
    ]


def run(
    store: ClickHouseStore, label: str, events: list[Event], rows: int, batch_rows: int, per_event: int
) -> None:
    per_batch = max(1, batch_rows // per_event)
    t0 = time.perf_counter()
    for i in range(0, len(events), per_batch):
        store.insert_events(events[i : i + per_batch])
    secs = time.perf_counter() - t0
    print(f"  {label:36} {rows:9,} rows in {secs:5.2f} s = {rows / secs:10,.0f} rows/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--batch", type=int, default=50_000)
    ap.add_argument("--chdb", action="store_true")
    args = ap.parse_args()
    base = load_settings().clickhouse
    targets = [("clickhouse 18.16 server", replace(base, database=f"bench_{uuid.uuid4().hex[:8]}"))]
    tmp = tempfile.TemporaryDirectory()
    if args.chdb:
        targets.append(("chdb 26.x in-process", replace(base, dsn=f"chdb://{tmp.name}", database="bench")))
    gpu = gpu_events(args.rows, 1_795_000_000_000)
    steps = step_events(args.rows, 1_795_000_000_000)
    for name, cfg in targets:
        store = ClickHouseStore(cfg)
        store.migrate()
        print(f"{name} (batches of {args.batch:,} rows, one process, gzip over HTTP for the server)")
        run(store, "gpu_samples (from GpuSampleBatch)", gpu, args.rows, args.batch, 8)
        run(store, "training_steps (from TrainingStep)", steps, args.rows, args.batch, 1)
        store.command(f"DROP DATABASE IF EXISTS {cfg.database}")
        store.close()
    tmp.cleanup()


if __name__ == "__main__":
    main()
