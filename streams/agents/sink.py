"""Sink agent: every registry topic -> ClickHouse, in batches bounded by size and time.

The batch's events are acknowledged only after the insert succeeded (``take_events`` acks after
the loop body), so when ClickHouse is down the agent retries with backoff, offsets stay
uncommitted, nothing is lost and the worker stays up.  Redelivered rows collapse in the
ReplacingMergeTree tables.  Inserts run in a thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from infra.clickhouse.store import ClickHouseStore, StoreError
from schemas.base import Event
from schemas.control import JobSpec
from streams.context import WorkerContext
from streams.jobs import JobDirectory

NAME = "sink"
log = logging.getLogger(__name__)


def register(ctx: WorkerContext, jobs: JobDirectory) -> ClickHouseStore:
    store = ClickHouseStore(ctx.settings.clickhouse)
    cfg = ctx.cfg.sink

    async def write(events: list[Event]) -> None:
        backoff = cfg.retry_backoff_s
        loop = asyncio.get_running_loop()
        while True:
            t0 = time.perf_counter()
            try:
                written = await loop.run_in_executor(None, store.insert_events, events)
            except StoreError as exc:
                ctx.metrics.sink_failures.inc()
                log.warning("ClickHouse insert failed (%s); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, cfg.retry_backoff_max_s)
                continue
            ctx.metrics.sink_latency.observe(time.perf_counter() - t0)
            for table, n in written.items():
                ctx.metrics.sink_rows.labels(table).inc(n)
            return

    @ctx.app.agent(ctx.faust_topics(*ctx.all_topics()), name=NAME)
    async def sink(stream: Any) -> None:
        async for batch in stream.take_events(cfg.batch_size, within=cfg.max_wait_s):
            events: list[Event] = []
            for event in batch:
                ev = await ctx.decode(event, NAME)
                if ev is not None:
                    events.append(ev)
                    if isinstance(ev, JobSpec):
                        jobs.remember(ev)
            if events:
                await write(events)
            ctx.metrics.processed(NAME, len(batch))

    return store
