"""Training agent: step telemetry and process exits -> NaN/spike, exit, stall and straggler detections.

Steps and exits are keyed by job, so a job's monitor lives on one worker.  A timer asks every
monitor of a job this worker currently owns for time-based findings (stall = hang suspicion,
stragglers), so a hang is noticed from missing progress, not from an NCCL timeout.  Monitors of
jobs whose partition moved to another worker are dropped (that worker now watches the job).
"""

from __future__ import annotations

from typing import Any

from detectors.job_monitor import JobMonitor
from detectors.windows import StreamClock
from schemas.base import Event, now_ms
from schemas.topics import EXITS, STEPS
from schemas.workload import ProcessExit, TrainingStep
from streams.context import WorkerContext

NAME = "training"


class Monitors:
    """job -> JobMonitor, plus the partition each job's events come from."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.by_job: dict[str, JobMonitor] = {}
        self.partition: dict[str, int] = {}
        #: stall checks use the stream's time, so a lagging worker does not see every job stall.
        self.clock = StreamClock(idle_s=1.0)

    def get(self, job: str) -> JobMonitor:
        if job not in self.by_job:
            self.by_job[job] = JobMonitor(job, self.ctx.cfg.monitor)
        return self.by_job[job]

    def owned(self, job: str) -> bool:
        try:
            assigned = {(tp.topic, tp.partition) for tp in self.ctx.app.consumer.assignment()}
        except Exception:  # consumer not started yet
            return True
        part = self.partition.get(job)
        return part is None or (STEPS.name, part) in assigned

    def reconfigure(self) -> None:
        """Apply a changed ``monitor`` config to every job (state is kept where it can be)."""
        for m in self.by_job.values():
            m.config = self.ctx.cfg.monitor
            m.spike.config, m.stall.config = m.config.spike, m.config.stall
            m.straggler.config, m.mfu.config = m.config.straggler, m.config.mfu


def register(ctx: WorkerContext) -> Monitors:
    monitors = Monitors(ctx)

    async def body(ev: Event) -> None:
        if isinstance(ev, TrainingStep):
            monitors.clock.observe(ev.ts_ms, now_ms())
            dets = monitors.get(ev.job).on_step(ev, now_ms())
        elif isinstance(ev, ProcessExit):
            dets = monitors.get(ev.job).on_exit(ev, now_ms()) if ev.job else []
        else:
            dets = []
        for det in dets:
            await ctx.emit(det)
            ctx.metrics.detections.labels(NAME).inc()

    @ctx.app.agent(ctx.faust_topics(STEPS, EXITS), name=NAME)
    async def training(stream: Any) -> None:
        async for event in stream.events():
            if event.message.topic == STEPS.name and isinstance(event.key, bytes):
                monitors.partition[event.key.decode(errors="replace")] = event.message.partition
            await ctx.guard(event, NAME, body)

    @ctx.app.timer(ctx.cfg.check_interval_s)
    async def check_jobs() -> None:
        now = now_ms()
        stream_now = monitors.clock.now(now)
        for job in list(monitors.by_job):
            if not monitors.owned(job):
                del monitors.by_job[job]
                continue
            for det in monitors.by_job[job].check(now, stream_now):
                await ctx.emit(det)
                ctx.metrics.detections.labels(NAME).inc()

    return monitors
