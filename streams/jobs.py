"""Job topologies for the workers: the jobs topic, followed by every worker, and ClickHouse's
``job_specs`` (latest spec per job) for what the worker has not read (yet).

:func:`follow` feeds every spec published on the jobs topic into the worker's
:class:`JobDirectory`, on every worker (not group-consumed: a job's decisions may be handled on
any worker).  Specs change rarely (job start, machine swaps), so store lookups are cached for
``ttl_s`` and run in a thread: a ClickHouse query never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

from trainguard.detectors.routing import INPUTS, JOB_SPECS, newer_spec
from trainguard.infra.clickhouse.store import ClickHouseStore, StoreError
from trainguard.infra.config import ClickHouseConfig
from trainguard.schemas.codec import DecodeError, decode
from trainguard.schemas.control import JobSpec
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.typecheck import SchemaError, from_mapping
from trainguard.streams.context import WorkerContext

log = logging.getLogger(__name__)


class JobDirectory:
    def __init__(self, cfg: ClickHouseConfig, ttl_s: float = 30.0) -> None:
        self.store = ClickHouseStore(cfg)
        # Lookups run in executor threads and one ClickHouse session takes one query at a time
        # ("Attempt to execute concurrent queries within the same session").
        self._store_lock = threading.Lock()
        self.ttl_s = ttl_s
        self._cache: dict[str, tuple[float, JobSpec | None]] = {}

    def _load(self, job: str) -> JobSpec | None:
        with self._store_lock:
            rows = self.store.query(
                "SELECT argMax(spec_json, ts_ms) FROM job_specs WHERE job = %(j)s GROUP BY job", {"j": job}
            )
        if not rows:
            return None
        try:
            return from_mapping(JobSpec, json.loads(rows[0][0]))
        except (SchemaError, ValueError) as exc:
            log.error("stored spec of job %s is invalid: %s", job, exc)
            return None

    async def spec(self, job: str) -> JobSpec | None:
        hit = self._cache.get(job)
        if hit is not None and time.monotonic() - hit[0] < self.ttl_s:
            return hit[1]
        try:
            spec = await asyncio.get_running_loop().run_in_executor(None, self._load, job)
        except StoreError as exc:
            log.warning("job spec lookup for %s failed: %s", job, exc)
            return hit[1] if hit else None
        if hit is not None and hit[1] is not None and (spec is None or not newer_spec(spec, hit[1])):
            spec = hit[1]  # read from the jobs topic and not in the store yet (the sink lags)
        self._cache[job] = (time.monotonic(), spec)
        return spec

    def remember(self, spec: JobSpec) -> None:
        """Take a spec seen on the jobs topic (fresher than the store)."""
        cached = self._cache.get(spec.job)
        if cached is None or newer_spec(spec, cached[1]):
            self._cache[spec.job] = (time.monotonic(), spec)

    async def topology(self, job: str) -> JobTopology | None:
        spec = await self.spec(job)
        return spec.topology if spec else None


def follow(ctx: WorkerContext, jobs: JobDirectory) -> None:
    """Every spec on the jobs topic -> ``jobs`` (garbage is skipped: the sink dead-letters it)."""

    def handle(raw: bytes | None) -> None:
        try:
            spec = decode(raw, expect=JobSpec)
        except DecodeError:
            return
        if isinstance(spec, JobSpec):
            jobs.remember(spec)

    for topic in INPUTS[JOB_SPECS]:
        ctx.follow(topic, handle, JOB_SPECS)
