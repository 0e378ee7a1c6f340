"""Aggregation agent (ByteRobust §5): on a hang or fail-slow suspicion, capture every rank's
stacks and find the parallel group to evict.

``aggregate`` decisions and stack dumps are both keyed by job (and co-partitioned), so one
worker sees a job's request and every answer.  A request becomes one ``capture_stacks`` command
per machine of the job (one round for a hang, ``fail_slow_rounds`` rounds ``fail_slow_interval_s``
apart for fail-slow); a timer closes captures that are complete or past their deadline and runs
the over-eviction classifier in a thread, off the event loop.  The result is a detection (kind
``over_eviction``) that the decide agent turns into an eviction of the group.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from detectors.capture import Capture
from detectors.detections import detection_from_finding
from detectors.findings import Finding
from schemas.base import Event, now_ms
from schemas.control import Command, CommandKind, Decision, stable_id
from schemas.enums import Action, Severity
from schemas.topics import COMMANDS, DECISIONS, STACKS
from schemas.workload import StackDump
from streams.context import WorkerContext
from streams.jobs import JobDirectory

NAME = "aggregation"
log = logging.getLogger(__name__)
_FAIL_SLOW = ("fail_slow", "straggler", "mfu_decline")


def register(ctx: WorkerContext, jobs: JobDirectory) -> dict[str, Capture]:
    pending: dict[str, Capture] = {}  # capture_id -> capture
    last_capture_ms: dict[str, int] = {}  # job -> when its last capture was requested

    async def start_capture(dec: Decision) -> None:
        cfg = ctx.cfg.aggregation
        now = now_ms()
        if any(c.job == dec.job for c in pending.values()):
            return  # one capture per job at a time
        if now - last_capture_ms.get(dec.job, -(10**15)) < cfg.cooldown_s * 1000:
            return
        spec = await jobs.spec(dec.job)
        if spec is None or not spec.topology.machines:
            # Without a topology the stacks cannot be localised: stop-time diagnosis instead.
            finding = Finding(
                kind="aggregation_unavailable",
                category="job_hang",
                severity=Severity.ERROR,
                action=Action.DIAGNOSE,
                job=dec.job,
                evidence={"reason": "no job spec with machines", "decision_id": dec.decision_id},
            )
            await ctx.emit(
                detection_from_finding(
                    finding, job=dec.job, source_ts_ms=dec.ts_ms, now_ms=now, source_key=dec.decision_id
                )
            )
            return
        category = str(dec.evidence.get("detection", {}).get("category", ""))
        rounds = cfg.fail_slow_rounds if category in _FAIL_SLOW else 1
        capture_id = stable_id("capture", dec.decision_id)
        deadline = now + int((cfg.deadline_s + (rounds - 1) * cfg.fail_slow_interval_s) * 1000)
        pending[capture_id] = Capture(
            capture_id, dec.job, spec.topology, rounds, deadline, now, dec.decision_id
        )
        last_capture_ms[dec.job] = now
        for node in spec.topology.machines:
            cmd = Command(
                command_id=stable_id(capture_id, node),
                ts_ms=now,
                kind=CommandKind.CAPTURE_STACKS,
                node=node,
                job=dec.job,
                args={"capture_id": capture_id, "rounds": rounds, "interval_s": cfg.fail_slow_interval_s},
            )
            await ctx.emit(cmd, COMMANDS)
        log.info(
            "capture %s requested from %d machines of %s", capture_id, len(spec.topology.machines), dec.job
        )

    async def body(ev: Event) -> None:
        if isinstance(ev, Decision) and ev.action is Action.AGGREGATE:
            await start_capture(ev)
        elif isinstance(ev, StackDump) and ev.capture_id in pending:
            pending[ev.capture_id].add(ev)

    @ctx.app.agent(ctx.faust_topics(DECISIONS, STACKS), name=NAME)
    async def aggregation(stream: Any) -> None:
        async for event in stream.events():
            await ctx.guard(event, NAME, body)

    @ctx.app.timer(1.0)
    async def close_captures() -> None:
        now = now_ms()
        for cid, cap in list(pending.items()):
            if not cap.ready(now):
                continue
            del pending[cid]
            try:
                det = await asyncio.get_running_loop().run_in_executor(None, cap.analyze, now)
            except Exception as exc:  # a bad capture must not stop the agent
                log.exception("over-eviction analysis of %s failed", cid)
                finding = Finding(
                    kind="aggregation_failed",
                    category="job_hang",
                    severity=Severity.ERROR,
                    action=Action.DIAGNOSE,
                    job=cap.job,
                    evidence={"error": str(exc), "capture_id": cid},
                )
                det = detection_from_finding(
                    finding, job=cap.job, source_ts_ms=cap.requested_ms, now_ms=now, source_key=cid
                )
            await ctx.emit(det)
            ctx.metrics.detections.labels(NAME).inc()

    return pending
