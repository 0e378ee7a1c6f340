"""A crash cascade decides on its root cause, not on the first peer error to arrive (exit_settle).

``tests/fixtures/exits/user-error-cascade.jsonl`` holds the seven exits with a traceback of a
real demo run's bad code push (run ``demo-20261124-090852``), in the order its stream worker
received them (``arrived_ms``): a peer's gloo "Connection closed by peer" first, the ``TypeError``
of the pushed code 60 ms later.  Without the wait the run's worker decided ``diagnose`` for the
gloo error first; the job was stopped for 2.5 s of stop-time tests before it was rolled back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainguard.detectors.exit_settle import SettleConfig
from trainguard.detectors.job_monitor import JobMonitor, MonitorConfig
from trainguard.detectors.keyed_state import PathState
from trainguard.detectors.replay import ReplayConfig
from trainguard.detectors.routing import TRAINING, DetectionPath
from trainguard.schemas.control import Decision, Detection
from trainguard.schemas.enums import Action
from trainguard.schemas.workload import ProcessExit

CASCADE = Path(__file__).resolve().parents[1] / "fixtures" / "exits" / "user-error-cascade.jsonl"


def _cascade() -> list[tuple[int, ProcessExit]]:
    rows: list[dict[str, Any]] = [json.loads(line) for line in CASCADE.read_text().splitlines()]
    return [(r.pop("arrived_ms"), ProcessExit(**r)) for r in rows]


def _run(
    exits: list[tuple[int, ProcessExit]], config: MonitorConfig, tick_ms: int = 500, until_ms: int = 3000
) -> list[Detection]:
    """Feed ``exits`` at their arrival times and check every ``tick_ms``, as the agent does."""
    m = JobMonitor(exits[0][1].job, config)
    out: list[Detection] = []
    start = exits[0][0]
    pending = list(exits)
    for now in range(start, start + until_ms, tick_ms):
        while pending and pending[0][0] <= now + tick_ms:
            arrived, e = pending.pop(0)
            out += m.on_exit(e, arrived)
        out += m.check(now + tick_ms)
    return out


def _acting(dets: list[Detection]) -> list[tuple[str, str]]:
    return [(d.category, d.action.value) for d in dets if d.action not in (Action.NONE, Action.IGNORE)]


def test_the_peer_error_that_arrives_first_waits_for_the_user_exception() -> None:
    dets = _run(_cascade(), MonitorConfig(settle=SettleConfig(settle_s=1.0)))
    assert {a for a in _acting(dets)} == {("user_code", "rollback")}
    secondary = [d for d in dets if d.category == "comm_error"]
    assert len(secondary) == 3 and all(d.action is Action.IGNORE for d in secondary)
    assert all("secondary to user_code" in d.message for d in secondary)
    # Decided through the real policy: one rollback, no diagnose.
    path = DetectionPath(ReplayConfig())
    decisions = [dec for d in dets if (dec := path.decide(d, d.ts_ms)) is not None]
    assert [dec.action for dec in decisions] == [Action.ROLLBACK]


def test_without_the_wait_the_first_peer_error_decides_diagnose_as_the_real_run_did() -> None:
    dets = _run(_cascade(), MonitorConfig(settle=SettleConfig(settle_s=0.0)))
    path = DetectionPath(ReplayConfig())
    decisions: list[Decision] = [dec for d in dets if (dec := path.decide(d, d.ts_ms)) is not None]
    assert decisions[0].action is Action.DIAGNOSE
    assert Action.ROLLBACK in [d.action for d in decisions]


def test_peer_errors_with_no_root_cause_are_acted_on_once_the_wait_is_over() -> None:
    gloo_only = [(t, e) for t, e in _cascade() if "gloo" in e.traceback]
    assert len(gloo_only) == 3
    m = JobMonitor(gloo_only[0][1].job, MonitorConfig(settle=SettleConfig(settle_s=1.0)))
    first = gloo_only[0][0]
    assert [d for t, e in gloo_only for d in m.on_exit(e, t)] == []
    assert m.check(first + 900) == []  # still waiting
    released = [d for d in m.check(gloo_only[-1][0] + 1000) if d.category == "comm_error"]
    assert len(released) == 3 and {d.action for d in released} == {Action.DIAGNOSE}


def test_a_held_peer_error_survives_a_worker_restart() -> None:
    path = DetectionPath(ReplayConfig())
    first, exit_ = _cascade()[0]
    assert path.findings(TRAINING, exit_, first) == []
    doc = PathState(path).snapshot(TRAINING, exit_.job)
    fresh = DetectionPath(ReplayConfig())
    PathState(fresh).restore(TRAINING, exit_.job, doc, first + 100)
    released = fresh.monitor(exit_.job).check(first + 1100)
    assert [(d.category, d.action) for d in released] == [("comm_error", Action.DIAGNOSE)]
