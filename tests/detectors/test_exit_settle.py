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
from types import SimpleNamespace
from typing import Any, cast

from trainguard.commands.launch import exit_event
from trainguard.detectors.exit_settle import SettleConfig
from trainguard.detectors.job_monitor import JobMonitor, MonitorConfig
from trainguard.detectors.keyed_state import PathState
from trainguard.detectors.replay import ReplayConfig
from trainguard.detectors.routing import TRAINING, DetectionPath
from trainguard.launch_env import LaunchPlan
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
    # The first to happen is acted on; the two after it, within the wait, are its echoes.
    assert [(d.node, d.ranks, d.action) for d in released] == [
        ("m2", [4], Action.DIAGNOSE),
        ("m3", [7], Action.IGNORE),
        ("m2", [5], Action.IGNORE),
    ]
    assert all("secondary to comm_error on m2 ranks [4]" in d.message for d in released[1:])


def test_a_held_peer_error_survives_a_worker_restart() -> None:
    path = DetectionPath(ReplayConfig())
    first, exit_ = _cascade()[0]
    assert path.findings(TRAINING, exit_, first) == []
    doc = PathState(path).snapshot(TRAINING, exit_.job)
    fresh = DetectionPath(ReplayConfig())
    PathState(fresh).restore(TRAINING, exit_.job, doc, first + 100)
    released = fresh.monitor(exit_.job).check(first + 1100)
    assert [(d.category, d.action) for d in released] == [("comm_error", Action.DIAGNOSE)]


# -- a rank killed by SIGKILL: the launcher's report names it ---------------------------------------------
#
# The survivors' exits are the real run's gloo "Connection closed by peer" exits (m2 rank 4, m3
# rank 7, m2 rank 5).  The rank that died first is made m1's rank 3, killed by SIGKILL 40 ms
# before the first survivor failed; its exit is what its launcher reports (``exit_event``, the
# launcher's own builder), arriving last: its node's exporter was the slower to deliver.


def _launcher_exit(like: ProcessExit, node: str, rank: int, returncode: int, ts_ms: int) -> ProcessExit:
    plan = cast(LaunchPlan, SimpleNamespace(job=like.job, node=node, rank=rank))
    return exit_event(plan, pid=40_000 + rank, returncode=returncode, ts_ms=ts_ms)


def _survivors() -> list[tuple[int, ProcessExit]]:
    """The gloo exits and, 5 ms after each, its launcher's word on it (exit 1: no traceback)."""
    out: list[tuple[int, ProcessExit]] = []
    for arrived, e in _cascade():
        if "gloo" in e.traceback:
            out += [(arrived, e), (arrived + 5, _launcher_exit(e, e.node, e.rank, 1, e.ts_ms + 5))]
    return out


def _decisions(dets: list[Detection]) -> list[Decision]:
    path = DetectionPath(ReplayConfig())
    return [dec for d in dets if (dec := path.decide(d, d.ts_ms)) is not None]


def test_a_sigkilled_rank_reported_by_its_launcher_is_the_culprit_not_the_survivors() -> None:
    survivors = _survivors()
    first_ms = min(e.ts_ms for _, e in survivors)
    kill = _launcher_exit(survivors[0][1], "m1", 3, -9, first_ms - 40)
    exits = sorted([*survivors, (survivors[0][0] + 600, kill)], key=lambda x: x[0])
    assert exits[-1][1] is kill  # the culprit's exit arrives last
    dets = _run(exits, MonitorConfig(settle=SettleConfig(settle_s=1.0)))
    assert [(d.category, d.kind, d.node, d.ranks) for d in dets if d.action is not Action.IGNORE] == [
        ("cpu_oom", "exit-sigkill", "m1", [3])
    ]
    echoes = [d for d in dets if d.action is Action.IGNORE]
    assert {(d.kind, d.node) for d in echoes} == {
        ("gloo-error", "m2"),
        ("gloo-error", "m3"),
        ("exit-nonzero", "m2"),
        ("exit-nonzero", "m3"),
    }
    assert len(echoes) == 6 and all("secondary to cpu_oom on m1 ranks [3]" in d.message for d in echoes)
    (decision,) = _decisions(dets)
    assert (decision.action, decision.targets.machines, decision.targets.ranks) == (
        Action.DIAGNOSE,
        ["m1"],
        [3],
    )


def test_without_the_launchers_report_the_survivor_was_blamed() -> None:
    # What the user trial saw: the killed rank's exit invisible (and no launcher's word on any
    # exit), so the first survivor's gloo error decided, on the healthy machine.
    gloo_only = [(t, e) for t, e in _cascade() if "gloo" in e.traceback]
    dets = _run(gloo_only, MonitorConfig(settle=SettleConfig(settle_s=1.0)))
    (decision,) = _decisions(dets)
    assert (decision.action, decision.targets.machines) == (Action.DIAGNOSE, ["m2"])


def test_among_exits_that_all_look_like_echoes_the_first_to_happen_decides() -> None:
    # The rank that died first exited 1 with no traceback (its launcher's word only), 40 ms before
    # the first survivor's gloo error, and its report arrived last: held until after the others'.
    survivors = _survivors()
    first_ms = min(e.ts_ms for _, e in survivors)
    root = _launcher_exit(survivors[0][1], "m1", 3, 1, first_ms - 40)
    exits = sorted([*survivors, (survivors[-1][0] + 200, root)], key=lambda x: x[0])
    dets = _run(exits, MonitorConfig(settle=SettleConfig(settle_s=1.0)), until_ms=4000)
    assert [(d.kind, d.node, d.ranks) for d in dets if d.action is not Action.IGNORE] == [
        ("exit-nonzero", "m1", [3])
    ]
    assert all("secondary to crash on m1 ranks [3]" in d.message for d in dets if d.action is Action.IGNORE)
    (decision,) = _decisions(dets)
    assert decision.targets.machines == ["m1"]
