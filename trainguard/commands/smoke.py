"""``trainguard smoke``: events through Kafka into ClickHouse, then a postmortem-style query.

Proves the stack end to end: produce GPU samples, step telemetry, an Xid kernel-log line and one
garbage record with kafka-python; run the sink (``trainguard.infra.sink.Sink``, the loop every stream worker
runs, here in its own consumer group) until every row is stored; print what ClickHouse says about
the run.  The garbage record must come back as a dead letter.
"""

from __future__ import annotations

import math
import random
import time
import uuid

import click

from trainguard.context import friendly_errors, settings
from trainguard.infra.bus import EventProducer
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.sink import Sink
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.telemetry import GpuSample, GpuSampleBatch
from trainguard.schemas.topics import LOGS
from trainguard.schemas.workload import LogLine, TrainingStep

GPUS_PER_NODE = 8


def smoke_events(job: str, nodes: int, rounds: int, ranks: int, t0: int) -> list[Event]:
    rnd = random.Random(7)
    events: list[Event] = []
    for r in range(rounds):
        ts = t0 + r * 10_000
        for n in range(nodes):
            gpus = [
                GpuSample(
                    index=i,
                    temperature_c=round(rnd.uniform(50, 70), 1),
                    util_gpu_pct=rnd.uniform(90, 100),
                    power_w=rnd.uniform(500, 700),
                    ecc_volatile_uncorrected=0,
                    pcie_replay_count=0,
                )
                for i in range(GPUS_PER_NODE)
            ]
            events.append(GpuSampleBatch(node=f"{job}-node{n}", ts_ms=ts, gpus=gpus, job=job))
        for rank in range(ranks):
            loss = 4.0 * math.exp(-r / 20) + rnd.uniform(0, 0.05)
            events.append(
                TrainingStep(
                    job=job,
                    rank=rank,
                    step=r,
                    ts_ms=ts + rank,
                    node=f"{job}-node{rank % nodes}",
                    loss=loss,
                    grad_norm=rnd.uniform(0.5, 1.5),
                    step_time_s=1.0,
                )
            )
    xid = "[ 8123.456789] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."
    events.append(LogLine(node=f"{job}-node0", ts_ms=t0 + 5, source="kernel", line=xid, seq=1, job=job))
    return events


@click.command()
@click.option("--nodes", default=2, show_default=True, type=click.IntRange(1, 1000))
@click.option("--rounds", default=10, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--ranks", default=4, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for the rows.")
@click.pass_context
@friendly_errors
def smoke(ctx: click.Context, nodes: int, rounds: int, ranks: int, timeout: float) -> None:
    """Send a small synthetic run through Kafka into ClickHouse and query it back."""
    s = settings(ctx)
    job = f"smoke-{uuid.uuid4().hex[:8]}"
    events = smoke_events(job, nodes, rounds, ranks, now_ms())
    producer = EventProducer(s.kafka)
    for ev in events:
        producer.send(ev)
    producer.send_raw(LOGS.name, b'{"schema": "log_line", "version": 1, "node": 42}', key=job.encode())
    producer.flush()
    producer.close()
    click.echo(f"produced {len(events)} events + 1 garbage record for job {job}")

    store = ClickHouseStore(s.clickhouse)
    sink = Sink(s)
    expected_steps = rounds * ranks
    deadline = time.monotonic() + timeout

    def complete() -> bool:
        return (
            store.count("training_steps", "job = %(j)s", {"j": job}) >= expected_steps
            and store.count("log_lines", "job = %(j)s", {"j": job}) >= 1
            and store.count("dead_letters", "key = %(j)s", {"j": job}) >= 1
        )

    last_check = [0.0]

    def should_stop() -> bool:  # checking ClickHouse every poll would dominate the loop
        if time.monotonic() - last_check[0] < 0.5:
            return False
        last_check[0] = time.monotonic()
        return time.monotonic() > deadline or complete()

    t0 = time.monotonic()
    stats = sink.run(should_stop)
    sink.close()
    elapsed = time.monotonic() - t0
    click.echo(
        f"sink stored {sum(stats.rows.values())} rows ({stats.dead_letters} dead letter) in {elapsed:.1f}s"
    )

    rows = store.query(
        "SELECT node, count() AS samples, round(toFloat64(max(temperature_c)), 1) AS max_temp_c "
        "FROM gpu_samples FINAL WHERE job = %(j)s GROUP BY node ORDER BY node",
        {"j": job},
    )
    click.echo("\nGPU samples per node:")
    for node, n, temp in rows:
        click.echo(f"  {node:28} samples={n:<5} max_temp_c={temp}")
    steps = store.query(
        "SELECT rank, max(step) AS last_step, round(argMax(loss, step), 4) AS last_loss "
        "FROM training_steps FINAL WHERE job = %(j)s GROUP BY rank ORDER BY rank",
        {"j": job},
    )
    click.echo("Last step per rank:")
    for rank, step, loss in steps:
        click.echo(f"  rank {rank:<4} step={step:<5} loss={loss}")
    for (line,) in store.query("SELECT line FROM log_lines FINAL WHERE job = %(j)s", {"j": job}):
        click.echo(f"Kernel log: {line}")
    for (reason,) in store.query("SELECT reason FROM dead_letters FINAL WHERE key = %(j)s", {"j": job}):
        click.echo(f"Dead letter: {reason}")
    store.close()
    if len(steps) != ranks or not complete():
        raise click.ClickException(f"smoke run incomplete after {timeout:.0f}s")


COMMANDS = [smoke]
