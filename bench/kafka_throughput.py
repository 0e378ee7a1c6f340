"""Benchmark: produce/consume msg/s with kafka-python and aiokafka on the running local broker.

Messages are real encoded ``TrainingStep`` events (~250 bytes JSON).  Each run uses a fresh
8-partition topic that is deleted afterwards.  Start the stack first (`trainguard stack up`).

    python bench/kafka_throughput.py [--messages 50000]

stderr shows the client being measured and the time so far; stdout holds the table.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

from trainguard.infra.config import load_settings
from trainguard.infra.progress import Progress
from trainguard.schemas.codec import encode
from trainguard.schemas.workload import TrainingStep


def payloads(n: int) -> list[bytes]:
    return [
        encode(
            TrainingStep(
                job="bench",
                rank=i % 64,
                step=i // 64,
                ts_ms=1_795_000_000_000 + i,
                loss=2.5,
                grad_norm=1.0,
                step_time_s=1.1,
                tokens=4096,
            )
        )
        for i in range(n)
    ]


def kafka_python(bootstrap: list[str], topic: str, data: list[bytes]) -> tuple[float, float]:
    from kafka import KafkaConsumer, KafkaProducer

    p = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, batch_size=256 * 1024, acks=1)
    t0 = time.perf_counter()
    for i, v in enumerate(data):
        p.send(topic, key=str(i % 64).encode(), value=v)
    p.flush()
    produce = len(data) / (time.perf_counter() - t0)
    p.close()
    c = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"b-{uuid.uuid4().hex}",
        auto_offset_reset="earliest",
        max_poll_records=5000,
        fetch_max_bytes=64 * 1024 * 1024,
    )
    got, t0 = 0, 0.0
    while got < len(data):
        for recs in c.poll(timeout_ms=1000).values():
            if not t0:
                t0 = time.perf_counter()
            got += len(recs)
    consume = got / (time.perf_counter() - t0)
    c.close()
    return produce, consume


async def aiokafka_run(bootstrap: list[str], topic: str, data: list[bytes]) -> tuple[float, float]:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    p = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, max_batch_size=256 * 1024, acks=1)
    await p.start()
    t0 = time.perf_counter()
    futs = [await p.send(topic, key=str(i % 64).encode(), value=v) for i, v in enumerate(data)]
    await asyncio.gather(*futs)
    produce = len(data) / (time.perf_counter() - t0)
    await p.stop()
    c = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"b-{uuid.uuid4().hex}",
        auto_offset_reset="earliest",
        max_poll_records=5000,
    )
    await c.start()
    got, t0 = 0, 0.0
    while got < len(data):
        res = await c.getmany(timeout_ms=1000, max_records=5000)
        for recs in res.values():
            if not t0:
                t0 = time.perf_counter()
            got += len(recs)
    consume = got / (time.perf_counter() - t0)
    await c.stop()
    return produce, consume


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=50_000)
    args = ap.parse_args()
    from kafka.admin import KafkaAdminClient, NewTopic

    bootstrap = load_settings().kafka.servers
    data = payloads(args.messages)
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    results = {}
    # stderr; the table comes after.  The ticking thread wakes twice a second at most: noise
    # against the clients' throughput.
    with Progress("kafka throughput", total=2, unit="clients") as bar, bar.ticking():
        for name in ("kafka-python", "aiokafka"):
            bar.update(detail=f"{name}: produce, then consume {args.messages:,} messages")
            topic = f"bench-{uuid.uuid4().hex[:8]}"
            admin.create_topics([NewTopic(topic, 8, 1)])
            try:
                if name == "kafka-python":
                    results[name] = kafka_python(bootstrap, topic, data)
                else:
                    results[name] = asyncio.run(aiokafka_run(bootstrap, topic, data))
            finally:
                admin.delete_topics([topic])
            bar.advance()
    admin.close()
    size = sum(map(len, data)) // len(data)
    print(f"{args.messages} TrainingStep messages (~{size} B each), 8 partitions, loopback")
    for name, (prod, cons) in results.items():
        print(f"  {name:13} produce {prod:9,.0f} msg/s   consume (group) {cons:9,.0f} msg/s")


if __name__ == "__main__":
    main()
