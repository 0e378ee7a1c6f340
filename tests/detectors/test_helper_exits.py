"""A DataLoader worker's exit is recorded, not acted on: its rank answers it (torch raises in the
main process, or the shadow loader takes over and kills the hung lane's workers itself).

``tests/fixtures/exits/shadow-loader-takeover-kill.jsonl`` is the exit a real demo run's exporter
published for the hung worker its shadow loader killed (run ``demo-20261127-095852``, rank 4 on
m2, SIGKILL).  Classified like a main process's SIGKILL it was a host OOM: the worker decided a
stop-time diagnosis and restarted a job that was training on."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from trainguard.detectors.decide import DecisionPolicy
from trainguard.detectors.job_monitor import JobMonitor, MonitorConfig
from trainguard.schemas.enums import Action, ProcessRole
from trainguard.schemas.workload import ProcessExit

KILL = Path(__file__).resolve().parents[1] / "fixtures" / "exits" / "shadow-loader-takeover-kill.jsonl"


def _worker_exit() -> ProcessExit:
    (line,) = KILL.read_text().splitlines()
    row = json.loads(line)
    return ProcessExit(**{**row, "role": ProcessRole(row["role"])})


def test_a_killed_dataloader_worker_is_recorded_not_acted_on() -> None:
    e = _worker_exit()
    assert e.role is ProcessRole.DATALOADER and e.signal == 9
    m = JobMonitor(e.job, MonitorConfig())
    (det,) = m.on_exit(e, e.ts_ms + 50)
    assert (det.kind, det.action, det.ranks, det.node) == ("exit-sigkill", Action.IGNORE, [4], "m2")
    assert det.evidence["recommended"] == "diagnose" and det.evidence["role"] == "dataloader"
    assert DecisionPolicy().decide(det, now_ms=det.ts_ms) is None
    assert m.alive.get(4) is not False  # the rank itself lives on


def test_the_same_signal_on_the_main_process_still_acts() -> None:
    e = replace(_worker_exit(), role=ProcessRole.MAIN)
    m = JobMonitor(e.job, MonitorConfig())
    dets = m.on_exit(e, e.ts_ms + 50) + m.check(e.ts_ms + 5_000)
    acting = [d for d in dets if d.action is not Action.IGNORE]
    assert [(d.kind, d.action) for d in acting] == [("exit-sigkill", Action.DIAGNOSE)]
    assert m.alive[4] is False
