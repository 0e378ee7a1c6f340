"""Incidents, not de-duplication windows (issue #36): a fault after a finished recovery is a new
incident with a new decision; repeats are merged only while the incident's recovery is at work,
or within the settle window of its first report.

The detections are the ones the recorded demo incidents (``tests/fixtures/incidents``) make when
replayed; the recovery's end is the action service's ``recovery`` event, which every worker
follows (:meth:`DetectionPath.on_action`).  In a user trial a second crash 98 s after the first
got no decision (the old 300 s window), and the job sat dead until the stopped-job detector fired.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import yaml

from trainguard.detectors.decide import DecideConfig, DecisionPolicy
from trainguard.detectors.keyed_state import PathState
from trainguard.detectors.replay import ReplayConfig, ReplayResult, decode_records, replay_events
from trainguard.detectors.routing import DECIDE, DetectionPath
from trainguard.infra.replay import read_recording
from trainguard.schemas.control import ActionEvent, ActionPhase, Decision, Detection, stable_id
from trainguard.schemas.enums import Action

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "incidents"
S = 1000


@cache
def _replayed(fault: str) -> ReplayResult:
    config = ReplayConfig.from_worker_section(yaml.safe_load((FIXTURES / "worker.yaml").read_text()))
    events, _ = decode_records(read_recording(FIXTURES / f"{fault}.jsonl"))
    prior, _ = decode_records(read_recording(FIXTURES / f"{fault}.prior.jsonl"))
    return replay_events(events, config, prior=[d for _, d in prior if isinstance(d, Decision)])


def _acting(fault: str) -> list[Detection]:
    """The detections of the recorded ``fault`` that ask for an action, in order."""
    return [d for d in _replayed(fault).detections if d.action not in (Action.NONE, Action.IGNORE)]


def _later(det: Detection, after_ms: int, tag: str) -> Detection:
    """``det`` happening again ``after_ms`` later (another report, another detection id)."""
    t = (det.source_ts_ms or det.ts_ms) + after_ms
    return replace(det, detection_id=f"{det.detection_id}-{tag}", source_ts_ms=t, ts_ms=det.ts_ms + after_ms)


def _ended(dec: Decision, at_ms: int, phase: ActionPhase = ActionPhase.SUCCEEDED) -> ActionEvent:
    """The action service's event for the end of ``dec``'s recovery."""
    return ActionEvent(
        event_id=stable_id(dec.decision_id, "recovery", phase.value),
        decision_id=dec.decision_id,
        ts_ms=at_ms,
        job=dec.job,
        step="recovery",
        phase=phase,
        action=dec.action,
    )


def _path(**decide: float) -> DetectionPath:
    return DetectionPath(ReplayConfig(decide=DecideConfig(**decide)))


def test_a_second_crash_98_s_after_the_first_recovery_finished_gets_a_decision() -> None:
    (crash,) = _acting("crash")
    assert (crash.kind, crash.action) == ("python-exception", Action.DIAGNOSE)
    path = _path()
    first = path.decide(crash, crash.ts_ms)
    assert first is not None
    path.on_action(_ended(first, crash.ts_ms + 6 * S))  # recovered in 6 s, as in the demo run
    second = path.decide(_later(crash, 98 * S, "again"), crash.ts_ms + 98 * S)
    assert second is not None and second.action is Action.DIAGNOSE
    assert second.decision_id != first.decision_id  # a redelivery of the first would be ignored
    # Without the end (the recovery still at work) the same report is merged, as before.
    busy = _path()
    assert busy.decide(crash, crash.ts_ms) is not None
    assert busy.decide(_later(crash, 98 * S, "again"), crash.ts_ms + 98 * S) is None


def test_repeats_while_the_recovery_runs_are_merged_and_late_ranks_within_the_settle_window_too() -> None:
    (crash,) = _acting("crash")
    path = _path(settle_s=20)
    first = path.decide(crash, crash.ts_ms)
    assert first is not None
    # Other ranks report the crash, out of order, and it goes on failing while the recovery works.
    for i, after in enumerate((1 * S, -1 * S, 45 * S, 120 * S)):
        assert path.decide(_later(crash, after, f"r{i}"), crash.ts_ms + abs(after)) is None
    assert path.policy.suppressed == 4
    path.on_action(_ended(first, crash.ts_ms + 5 * S))
    # A straggling rank's report of the same crash, 15 s after it: still that incident.
    assert path.decide(_later(crash, 15 * S, "late"), crash.ts_ms + 16 * S) is None
    # The job running again does not end it twice: a step event is no recovery's end.
    started = replace(_ended(first, crash.ts_ms + 1), step="restart", phase=ActionPhase.SUCCEEDED)
    path.on_action(started)
    assert path.decide(_later(crash, 25 * S, "next"), crash.ts_ms + 25 * S) is not None


def test_an_incident_whose_end_is_never_heard_merges_for_at_most_incident_max_s() -> None:
    (crash,) = _acting("crash")
    path = _path(settle_s=20, incident_max_s=300)
    assert path.decide(crash, crash.ts_ms) is not None
    assert path.decide(_later(crash, 299 * S, "a"), crash.ts_ms + 299 * S) is None
    assert path.decide(_later(crash, 300 * S, "b"), crash.ts_ms + 300 * S) is not None


def test_ids_are_deterministic_across_a_replay_of_the_same_detections_and_events() -> None:
    (crash,) = _acting("crash")

    def run() -> list[str]:
        path, ids = _path(), []
        for after in (0, 2 * S, 98 * S, 99 * S, 250 * S):
            dec = path.decide(_later(crash, after, str(after)), crash.ts_ms + after)
            if dec is not None:
                ids.append(dec.decision_id)
                path.on_action(_ended(dec, crash.ts_ms + after + 5 * S))
        return ids

    ids = run()
    assert len(ids) == 3 and len(set(ids)) == 3  # 0 (2 s: merged), 98 (99: merged), 250
    assert run() == ids


def test_an_evicted_machine_reporting_on_stays_one_incident_unless_the_eviction_failed() -> None:
    # The NIC of the recorded run stayed down and its exporter reported it every 5 s.
    reports = [d for d in _acting("nic-down") if d.kind == "nic-state-down"]
    assert len(reports) > 5 and len({d.node for d in reports}) == 1
    path = _path(settle_s=20)
    first = path.decide(reports[0], reports[0].ts_ms)
    assert first is not None
    path.on_action(_ended(first, reports[0].ts_ms + 6 * S))  # evicted
    assert [path.decide(d, d.ts_ms) for d in reports[1:]] == [None] * (len(reports) - 1)
    # An eviction that failed left the machine in the job: its next report is a new incident.
    failed = _path(settle_s=20)
    first = failed.decide(reports[0], reports[0].ts_ms)
    assert first is not None
    failed.on_action(_ended(first, reports[0].ts_ms + 6 * S, ActionPhase.FAILED))
    after = [d for d in reports if (d.source_ts_ms or 0) - (reports[0].source_ts_ms or 0) >= 20 * S]
    assert failed.decide(after[0], after[0].ts_ms) is not None


def test_a_hang_capture_incident_ends_with_the_eviction_it_led_to_not_with_its_own_end() -> None:
    suspicion, verdict = _acting("hang")
    assert suspicion.action is Action.AGGREGATE
    assert (verdict.kind, verdict.action) == ("over_eviction", Action.EVICT)
    path = _path(settle_s=20)
    aggregate = path.decide(suspicion, suspicion.ts_ms)
    assert aggregate is not None
    path.on_action(_ended(aggregate, suspicion.ts_ms + 100))  # "ignored: handled by the workers"
    assert path.decide(_later(suspicion, 40 * S, "a"), suspicion.ts_ms + 40 * S) is None
    evict = path.decide(verdict, verdict.ts_ms)
    assert evict is not None
    path.on_action(_ended(evict, verdict.ts_ms + 10 * S))
    again = path.decide(_later(suspicion, 60 * S, "b"), suspicion.ts_ms + 60 * S)
    assert again is not None and again.action is Action.AGGREGATE


def test_an_end_of_an_unknown_or_other_decision_ends_nothing() -> None:
    (crash,) = _acting("crash")
    (oom,) = _acting("oom")
    path = _path(settle_s=20)
    first = path.decide(crash, crash.ts_ms)
    other = path.decide(replace(oom, job=crash.job), crash.ts_ms)
    assert first is not None and other is not None
    path.on_action(_ended(other, crash.ts_ms + 5 * S))  # the OOM's restart ended, not the crash's
    unknown = replace(first, decision_id="not-decided-here")
    path.on_action(_ended(unknown, crash.ts_ms + 5 * S))
    assert path.decide(_later(crash, 98 * S, "again"), crash.ts_ms + 98 * S) is None


def test_incidents_and_their_ends_move_with_the_job() -> None:
    (crash,) = _acting("crash")
    a = PathState(_path())
    first = a.path.decide(crash, crash.ts_ms)
    assert first is not None
    a.take_dirty(DECIDE)
    a.path.on_action(_ended(first, crash.ts_ms + 6 * S))
    assert a.take_dirty(DECIDE) == {crash.job}  # the end is state too: written to the changelog
    b = PathState(_path())
    b.restore(DECIDE, crash.job, a.snapshot(DECIDE, crash.job), now_ms=0)
    assert b.path.decide(_later(crash, 2 * S, "rank"), crash.ts_ms + 2 * S) is None  # settling
    assert b.path.decide(_later(crash, 98 * S, "again"), crash.ts_ms + 98 * S) is not None


def test_a_state_document_from_before_incidents_restores_as_open_incidents() -> None:
    (crash,) = _acting("crash")
    policy = DecisionPolicy()
    key = ("j", Action.DIAGNOSE.value, ("crash",))
    policy.restore_entries("j", [(key, crash.source_ts_ms)])  # the (key, ms) pairs of old documents
    assert policy.decide(replace(crash, job="j"), crash.ts_ms) is None
    with pytest.raises(ValueError, match="not an incident entry"):
        policy.restore_entries("j", [(key,)])
