"""Job topologies for the workers, read from ClickHouse's ``job_specs`` (latest spec per job).

Specs change rarely (job start, machine swaps), so lookups are cached for ``ttl_s`` and run in a
thread: a ClickHouse query never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from infra.clickhouse.store import ClickHouseStore, StoreError
from infra.config import ClickHouseConfig
from schemas.control import JobSpec
from schemas.topology import JobTopology
from schemas.typecheck import SchemaError, from_mapping

log = logging.getLogger(__name__)


class JobDirectory:
    def __init__(self, cfg: ClickHouseConfig, ttl_s: float = 30.0) -> None:
        self.store = ClickHouseStore(cfg)
        self.ttl_s = ttl_s
        self._cache: dict[str, tuple[float, JobSpec | None]] = {}

    def _load(self, job: str) -> JobSpec | None:
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
        self._cache[job] = (time.monotonic(), spec)
        return spec

    def remember(self, spec: JobSpec) -> None:
        """Take a spec seen on the jobs topic (fresher than the store)."""
        cached = self._cache.get(spec.job)
        if cached is None or cached[1] is None or cached[1].ts_ms <= spec.ts_ms:
            self._cache[spec.job] = (time.monotonic(), spec)

    async def topology(self, job: str) -> JobTopology | None:
        spec = await self.spec(job)
        return spec.topology if spec else None
