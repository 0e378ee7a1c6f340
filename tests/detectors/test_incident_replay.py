"""Recorded demo incidents, one per fault kind, replayed through the detectors (issue: incident replay).

``tests/fixtures/incidents`` holds what a real ``trainguard demo`` run put on the detectors'
input topics around each injected fault (``scripts/record_incidents.py``), the worker config
it ran with and, in ``expected.yaml``, what its stream worker decided.  Each recording is
replayed offline through :mod:`detectors.replay` (the agents' detectors, the records' own
clock) and must decide what the real run decided, and what the project's rules say the fault
calls for.  The slow test replays recordings into the real broker for a fresh real worker.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from detectors.replay import ReplayConfig, ReplayResult, decode_records, replay_events
from infra.config import Settings
from infra.replay import read_recording, replay
from schemas.control import Decision
from schemas.topics import DECISIONS
from tests.streams.harness import Watcher, WorkerProcess, unique

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "incidents"
ROWS: list[dict[str, Any]] = yaml.safe_load((FIXTURES / "expected.yaml").read_text())
WORKER_SECTION: dict[str, Any] = yaml.safe_load((FIXTURES / "worker.yaml").read_text())
CONFIG = ReplayConfig.from_worker_section(WORKER_SECTION)
FAULTS = (
    "xid",
    "nic-down",
    "nic-flap",
    "gpu-lost",
    "hang",
    "hang-dataloader",
    "hang-checkpoint",
    "slow",
    "nan",
    "crash",
    "user-error",
    "oom",
)
#: faults whose real run did not decide what the rules ask for (the demo is being fixed): the
#: replay reproduces the real run, and the rule check fails, on purpose, until the fix.
WRONG_IN_REAL_RUN: dict[str, str] = {}

Decided = list[tuple[str, list[str]]]


def _replayed(row: dict[str, Any]) -> ReplayResult:
    events, rejected = decode_records(read_recording(FIXTURES / row["recording"]))
    assert not rejected, rejected
    assert events, f"{row['recording']} is empty"
    return replay_events(events, CONFIG)


def _since_injection(decisions: list[Decision], row: dict[str, Any]) -> Decided:
    return [
        (d.action.value, sorted(d.targets.machines)) for d in decisions if d.ts_ms >= row["injected_at_ms"]
    ]


def _real(row: dict[str, Any]) -> Decided:
    return [(d["action"], sorted(d["machines"])) for d in row["decisions"]]


def _rule_params() -> list[Any]:
    return [
        pytest.param(
            r,
            id=r["fault"],
            marks=[pytest.mark.xfail(strict=True, reason=WRONG_IN_REAL_RUN[r["fault"]])]
            if r["fault"] in WRONG_IN_REAL_RUN
            else [],
        )
        for r in ROWS
    ]


def test_every_fault_kind_has_a_recording() -> None:
    assert sorted(r["fault"] for r in ROWS) == sorted(FAULTS)
    for r in ROWS:
        size = (FIXTURES / r["recording"]).stat().st_size
        assert 0 < size < 1_600_000, (r["recording"], size)


@pytest.mark.parametrize("row", ROWS, ids=[r["fault"] for r in ROWS])
def test_replay_decides_what_the_real_run_decided(row: dict[str, Any]) -> None:
    result = _replayed(row)
    assert _since_injection(result.decisions, row) == _real(row)


def _evicts(decided: Decided, machine: str, exact: bool) -> bool:
    return any(a == "evict" and (m == [machine] if exact else machine in m) for a, m in decided)


def _acting(decided: Decided) -> Decided:
    return [(a, m) for a, m in decided if a != "aggregate"]


@pytest.mark.parametrize("row", _rule_params())
def test_replay_decides_what_the_fault_calls_for(row: dict[str, Any]) -> None:
    fault, machine = row["fault"], row["machine"]
    result = _replayed(row)
    decided = _since_injection(result.decisions, row)
    acting = _acting(decided)
    if fault in ("xid", "gpu-lost", "nic-down"):
        # A machine-specific explicit fault: evict that machine, and only it, first.
        assert acting and acting[0] == ("evict", [machine]), decided
    elif fault == "nic-flap":
        # Two carrier drops within a minute: recorded, tolerated, nobody evicted.
        assert not any(a == "evict" for a, _ in decided), decided
        assert any(d.node == machine and d.category == "nic" for d in result.detections)
    elif fault in ("hang", "hang-dataloader", "hang-checkpoint", "slow"):
        # Hang / fail-slow suspicion: capture stacks first, then evict the group of the culprit.
        assert decided and decided[0][0] == "aggregate", decided
        first = next(d for d in result.decisions if d.ts_ms >= row["injected_at_ms"])
        category = first.evidence["detection"]["category"]
        assert category in (("fail_slow", "straggler", "mfu_decline") if fault == "slow" else ("hang",))
        assert acting and acting[0][0] == "evict" and machine in acting[0][1], decided
    else:
        want = {"oom": "restart", "crash": "diagnose", "nan": "diagnose", "user-error": "rollback"}[fault]
        assert acting and acting[0][0] == want, decided


# --- the same recordings through the real broker and a real worker -------------------------------


def _flat_env(section: dict[str, Any], prefix: str = "TRAINGUARD__WORKER") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in section.items():
        name = f"{prefix}__{key.upper()}"
        out.update(_flat_env(value, name) if isinstance(value, dict) else {name: str(value)})
    return out


def _renamed_copy(row: dict[str, Any], job: str, tag: str, out: Path, start_ms: int) -> tuple[int, Path]:
    """The recording with its job and machines renamed and event times moved to ``start_ms``.

    The detectors measure stalls against the wall clock, so events must look as fresh as when
    they were recorded; the new names keep the replay apart from every other job and node.
    """
    records = list(read_recording(FIXTURES / row["recording"]))
    values = [json.loads(r["value"]) for r in records]
    old_job = next(v["job"] for v in values if v.get("schema") == "job_spec")
    nodes = {n for v in values if v.get("schema") == "job_spec" for n in v["topology"]["machines"]}
    nodes |= {n for v in values if v.get("schema") == "job_spec" for n in v.get("standbys", [])}
    names = {old_job: job, **{n: f"{tag}-{n}" for n in nodes}}
    shift = start_ms - int(records[0]["ts_ms"])

    def rename(x: Any) -> Any:
        if isinstance(x, str):
            return names.get(x, x)
        if isinstance(x, list):
            return [rename(v) for v in x]
        if isinstance(x, dict):
            return {k: rename(v) for k, v in x.items()}
        return x

    path = out / f"{tag}.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for rec, value in zip(records, values, strict=True):
            value = rename(value)
            if isinstance(value.get("ts_ms"), int):
                value["ts_ms"] += shift
            line = {
                **rec,
                "key": rename(rec["key"]),
                "value": json.dumps(value),
                "ts_ms": rec["ts_ms"] + shift,
            }
            fh.write(json.dumps(line) + "\n")
    return shift, path


#: machine faults and exits: decided from the inputs alone (a hang's stack capture would need the
#: recorded dumps to answer the new worker's capture id, which only the offline replay maps).
THROUGH_KAFKA = ("xid", "nic-down", "crash")


@pytest.mark.slow
def test_real_worker_decides_what_the_real_run_decided(stack_settings: Settings, tmp_path: Path) -> None:
    env = {**_flat_env(WORKER_SECTION), "TRAINGUARD__WORKER__SINK__MAX_WAIT_S": "0.3"}
    worker = WorkerProcess(unique("tg-incidents"), 16197, tmp_path / "worker.log", env, stack_settings)
    worker.start()
    watcher = Watcher(stack_settings, DECISIONS)
    try:
        rows = [r for r in ROWS if r["fault"] in THROUGH_KAFKA]
        start_ms = int(time.time() * 1000) + 1000
        plans = []
        for row in rows:
            tag = unique(row["fault"])
            shift, path = _renamed_copy(row, f"{tag}-job", tag, tmp_path, start_ms)
            plans.append((row, f"{tag}-job", shift, tag, path))
        threads = [
            threading.Thread(target=replay, args=(stack_settings.kafka, path), kwargs={"speed": 1.0})
            for *_, path in plans
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        watcher.all(lambda e: True, settle_s=5.0)
        for row, job, shift, tag, _ in plans:
            got = [
                (e.action.value, sorted(m.removeprefix(f"{tag}-") for m in e.targets.machines))
                for e in watcher.seen
                if isinstance(e, Decision) and e.job == job and e.ts_ms >= row["injected_at_ms"] + shift
            ]
            assert got == _real(row), (row["fault"], got)
    finally:
        watcher.close()
        worker.stop()
