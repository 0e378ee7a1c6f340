"""Escalation counts incidents of the same cause (issue #36): a crash after an unrelated recovery
(an Xid eviction) starts at the first rung; only an earlier incident of the same cause within
``escalation_window_s`` -- or a code update, whose crash points at the code -- raises the rung.

The faults are the recorded demo run's (``tests/fixtures/incidents``): an Xid 79 and a Python
exception, as the decide stage turns them into decisions.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tests.actions.conftest import job_spec
from tests.actions.runner_harness import Harness, recorded_detections
from trainguard.actions.plans import CodeUpdate, Escalation
from trainguard.actions.progress import Recovery
from trainguard.detectors.decide import DecisionPolicy
from trainguard.schemas.control import Decision
from trainguard.schemas.enums import Action

JOB = "job-esc"
S = 1000


def _decided(fault: str, at_ms: int) -> Decision:
    """The recorded ``fault``'s first acting detection, happening to ``JOB`` at ``at_ms``."""
    det = recorded_detections(fault)[0]
    node = f"{JOB}-n1"
    moved = replace(det, job=JOB, node=node, source_ts_ms=at_ms, ts_ms=at_ms + 200)
    dec = DecisionPolicy().decide(moved, now_ms=at_ms + 300)
    assert dec is not None
    return dec


def _recover(h: Harness, dec: Decision) -> Recovery:
    h.now = (dec.evidence.get("detection", {}).get("source_ts_ms") or dec.ts_ms) + 1 * S
    h.accept(dec)
    return h.run(dec)


def _level(rec: Recovery) -> int:
    assert rec.context is not None
    return int(rec.context["plan"]["level"])


def test_a_crash_after_an_unrelated_xid_eviction_starts_at_the_first_rung(tmp_path: Path) -> None:
    h = Harness(tmp_path, job_spec(JOB, n=4, standbys=2))
    xid = _recover(h, _decided("xid", 1_000_000))
    assert xid.path == "evict" and xid.next_level == Escalation.ROLLBACK
    crash = _recover(h, _decided("crash", 1_060_000))  # a minute later, another cause
    assert crash.decision.action is Action.DIAGNOSE
    assert _level(crash) == Escalation.REATTEMPT and crash.path == "reattempt"
    # The same cause again within the window: "it fails again", one rung up (nothing to roll
    # back to: the plan goes on to the replay, which finds no faulty machine in a dry run).
    again = _recover(h, _decided("crash", 1_200_000))
    assert _level(again) == Escalation.ROLLBACK and again.held_reason.startswith("replay did not isolate")


def test_the_same_cause_outside_the_window_starts_over(tmp_path: Path) -> None:
    h = Harness(tmp_path, job_spec(JOB, n=4, standbys=2), escalation_window_s=600)
    first = _recover(h, _decided("crash", 1_000_000))
    assert first.path == "reattempt"
    later = _recover(h, _decided("crash", 1_000_000 + 602 * S))
    assert _level(later) == Escalation.REATTEMPT and later.path == "reattempt"


def test_a_crash_right_after_a_code_update_still_rolls_it_back(tmp_path: Path) -> None:
    h = Harness(tmp_path, job_spec(JOB, n=4, standbys=2))
    h.now = 1_000_000
    update = CodeUpdate("v2", urgent=True, previous="v1").decision(JOB, "update-v2", h.now)
    h.accept(update)
    assert h.run(update).path == "update"
    crash = _recover(h, _decided("crash", 1_030_000))
    assert _level(crash) == Escalation.ROLLBACK and crash.path == "rollback"
    assert [c["args"]["version"] for c in h.calls("hot_update")] == ["v2", "v1"]
