"""Events -> ClickHouse rows: which table each event type lands in and how it is flattened.

One function per event type returns ``(table, rows)``; rows are dicts keyed by column name.
Nested lists become parallel arrays (``disk_mounts``/``disk_used_bytes``) or a JSON column when
they are only read whole (stack frames, evidence).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from schemas.base import Event
from schemas.control import ActionEvent, Command, DeadLetter, Decision, Detection, JobSpec
from schemas.telemetry import GpuSampleBatch, Heartbeat, HostSample, NicSampleBatch
from schemas.typecheck import to_plain
from schemas.workload import LogLine, ProcessExit, StackDump, TrainingStep

Row = dict[str, Any]


def ts(ts_ms: int) -> datetime:
    return datetime.fromtimestamp(ts_ms / 1000, tz=UTC)


def _b(v: bool | None) -> int | None:
    return None if v is None else int(v)


def _json(v: Any) -> str:
    return json.dumps(to_plain(v), separators=(",", ":"), sort_keys=True, default=str)


def _base(e: Any) -> Row:
    return {"ts": ts(e.ts_ms), "ts_ms": e.ts_ms}


def line_hash(line: str) -> int:
    return int.from_bytes(hashlib.sha1(line.encode()).digest()[:8], "big")


def _gpu(e: GpuSampleBatch) -> list[Row]:
    base = _base(e)  # once per batch: one datetime for its 8 GPU rows
    return [
        {
            **base,
            "node": e.node,
            "job": e.job,
            "gpu": g.index,
            "uuid": g.uuid,
            "state": g.state.value,
            "util_gpu_pct": g.util_gpu_pct,
            "util_mem_pct": g.util_mem_pct,
            "mem_used_bytes": g.mem_used_bytes,
            "mem_total_bytes": g.mem_total_bytes,
            "temperature_c": g.temperature_c,
            "power_w": g.power_w,
            "sm_clock_mhz": g.sm_clock_mhz,
            "throttle_mask": g.throttle_mask,
            "throttle_reasons": list(g.throttle_reasons),
            "ecc_volatile_corrected": g.ecc_volatile_corrected,
            "ecc_volatile_uncorrected": g.ecc_volatile_uncorrected,
            "ecc_aggregate_corrected": g.ecc_aggregate_corrected,
            "ecc_aggregate_uncorrected": g.ecc_aggregate_uncorrected,
            "retired_pages_pending": _b(g.retired_pages_pending),
            "remapped_rows_correctable": g.remapped_rows_correctable,
            "remapped_rows_uncorrectable": g.remapped_rows_uncorrectable,
            "remap_pending": _b(g.remap_pending),
            "remap_failure": _b(g.remap_failure),
            "pcie_replay_count": g.pcie_replay_count,
            "nvlink_errors": g.nvlink_errors,
            "error": g.error,
        }
        for g in e.gpus
    ]


def _host(e: HostSample) -> list[Row]:
    return [
        {
            **_base(e),
            "node": e.node,
            "job": e.job,
            "cpu_util_pct": e.cpu_util_pct,
            "load1": e.load1,
            "load5": e.load5,
            "load15": e.load15,
            "mem_total_bytes": e.mem_total_bytes,
            "mem_available_bytes": e.mem_available_bytes,
            "swap_total_bytes": e.swap_total_bytes,
            "swap_used_bytes": e.swap_used_bytes,
            "process_count": e.process_count,
            "disk_mounts": [d.mount for d in e.disks],
            "disk_total_bytes": [d.total_bytes for d in e.disks],
            "disk_used_bytes": [d.used_bytes for d in e.disks],
        }
    ]


def _nic(e: NicSampleBatch) -> list[Row]:
    base = _base(e)
    return [
        {
            **base,
            "node": e.node,
            "job": e.job,
            "nic": n.name,
            "kind": n.kind,
            "operstate": n.operstate,
            "carrier": _b(n.carrier),
            "carrier_changes": n.carrier_changes,
            "rx_bytes": n.rx_bytes,
            "tx_bytes": n.tx_bytes,
            "rx_errors": n.rx_errors,
            "tx_errors": n.tx_errors,
            "rx_dropped": n.rx_dropped,
            "tx_dropped": n.tx_dropped,
            "counter_names": sorted(n.counters),
            "counter_values": [n.counters[k] for k in sorted(n.counters)],
        }
        for n in e.nics
    ]


def _heartbeat(e: Heartbeat) -> list[Row]:
    return [
        {
            **_base(e),
            "node": e.node,
            "component": e.component,
            "job": e.job,
            "seq": e.seq,
            "source_names": [s.name for s in e.sources],
            "source_ok": [int(s.ok) for s in e.sources],
            "source_errors": [s.error_count for s in e.sources],
            "sources_json": _json(e.sources),
        }
    ]


def _step(e: TrainingStep) -> list[Row]:
    return [
        {
            **_base(e),
            "job": e.job,
            "rank": e.rank,
            "step": e.step,
            "node": e.node,
            "loss": e.loss,
            "grad_norm": e.grad_norm,
            "step_time_s": e.step_time_s,
            "tokens": e.tokens,
            "tokens_per_s": e.tokens_per_s,
            "mfu": e.mfu,
            "dropped": e.dropped,
        }
    ]


def _log(e: LogLine) -> list[Row]:
    return [
        {
            **_base(e),
            "node": e.node,
            "job": e.job,
            "rank": e.rank,
            "source": e.source,
            "seq": e.seq,
            "line_hash": line_hash(e.line),
            "line": e.line,
        }
    ]


def _exit(e: ProcessExit) -> list[Row]:
    return [
        {
            **_base(e),
            "node": e.node,
            "job": e.job,
            "rank": e.rank,
            "pid": e.pid,
            "role": e.role.value,
            "exit_code": e.exit_code,
            "signal": e.signal,
            "reason": e.reason,
            "traceback": e.traceback,
        }
    ]


def _stack(e: StackDump) -> list[Row]:
    main = next((t for t in e.threads if t.frames), None)
    top = [f"{f.function} ({f.filename}:{f.line})" for f in (main.frames[:5] if main else [])]
    return [
        {
            **_base(e),
            "job": e.job,
            "capture_id": e.capture_id,
            "round": e.round,
            "node": e.node,
            "rank": e.rank,
            "pid": e.pid,
            "role": e.role.value,
            "top_frames": top,
            "threads_json": _json(e.threads),
            "process_tree_json": _json(e.process_tree),
            "raw_text": e.raw_text,
            "error": e.error,
        }
    ]


def _detection(e: Detection) -> list[Row]:
    return [
        {
            **_base(e),
            "detection_id": e.detection_id,
            "job": e.job,
            "kind": e.kind,
            "category": e.category,
            "severity": e.severity.value,
            "action": e.action.value,
            "node": e.node,
            "ranks": list(e.ranks),
            "score": e.score,
            "message": e.message,
            "evidence": _json(e.evidence),
            "source_ts_ms": e.source_ts_ms,
        }
    ]


def _decision(e: Decision) -> list[Row]:
    return [
        {
            **_base(e),
            "decision_id": e.decision_id,
            "job": e.job,
            "action": e.action.value,
            "machines": list(e.targets.machines),
            "ranks": list(e.targets.ranks),
            "group_kind": e.targets.group_kind,
            "reason": e.reason,
            "detection_ids": list(e.detection_ids),
            "evidence": _json(e.evidence),
        }
    ]


def _action(e: ActionEvent) -> list[Row]:
    return [
        {
            **_base(e),
            "event_id": e.event_id,
            "decision_id": e.decision_id,
            "job": e.job,
            "step": e.step,
            "phase": e.phase.value,
            "action": e.action.value,
            "duration_ms": e.duration_ms,
            "detail": e.detail,
            "machines": list(e.targets.machines),
            "ranks": list(e.targets.ranks),
        }
    ]


def _command(e: Command) -> list[Row]:
    return [
        {
            **_base(e),
            "command_id": e.command_id,
            "kind": e.kind.value,
            "node": e.node,
            "job": e.job,
            "args": _json(e.args),
        }
    ]


def _dead(e: DeadLetter) -> list[Row]:
    return [
        {
            **_base(e),
            "topic": e.topic,
            "stage": e.stage,
            "reason": e.reason,
            "partition": e.partition,
            "offset": e.offset,
            "key": e.key,
            "payload": e.payload,
            "payload_b64": int(e.payload_b64),
        }
    ]


def _job(e: JobSpec) -> list[Row]:
    t = e.topology
    return [
        {
            **_base(e),
            "job": e.job,
            "tp": t.tp,
            "pp": t.pp,
            "dp": t.dp,
            "ranks_per_machine": t.ranks_per_machine,
            "rank_order": t.order,
            "machines": list(t.machines),
            "standbys": list(e.standbys),
            "spec_json": _json(e),
        }
    ]


#: event class -> (table, flattener)
TABLES: dict[type[Event], tuple[str, Callable[[Any], list[Row]]]] = {
    GpuSampleBatch: ("gpu_samples", _gpu),
    HostSample: ("host_samples", _host),
    NicSampleBatch: ("nic_samples", _nic),
    Heartbeat: ("heartbeats", _heartbeat),
    TrainingStep: ("training_steps", _step),
    LogLine: ("log_lines", _log),
    ProcessExit: ("process_exits", _exit),
    StackDump: ("stack_dumps", _stack),
    Detection: ("detections", _detection),
    Decision: ("decisions", _decision),
    ActionEvent: ("action_events", _action),
    Command: ("commands", _command),
    DeadLetter: ("dead_letters", _dead),
    JobSpec: ("job_specs", _job),
}

#: tables holding raw telemetry, pruned by day (``trainguard store prune``).
TELEMETRY_TABLES = (
    "gpu_samples",
    "host_samples",
    "nic_samples",
    "heartbeats",
    "training_steps",
    "log_lines",
    "process_exits",
    "stack_dumps",
)


def rows_by_table(events: list[Event]) -> dict[str, list[Row]]:
    """Group the rows of many events by destination table (one insert per table)."""
    out: dict[str, list[Row]] = {}
    for ev in events:
        table, flatten = TABLES[type(ev)]
        out.setdefault(table, []).extend(flatten(ev))
    return out
