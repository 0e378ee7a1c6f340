"""The stopped-job detector on a recorded stream: the real ``crash`` incident of a demo run.

The recording holds the job's steps, the crash (rank 6 raised) and the SIGTERMs of the other
ranks as the recovery stopped the job, then the restarted generation's steps.  Cut after the
stop, it is the stream of a job whose recovery never brought it back; the action service's
events that would accompany it are added here, in the form the service emits them.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from trainguard.detectors.job_monitor import JobMonitor, MonitorConfig
from trainguard.detectors.replay import OfflinePipeline, ReplayConfig, decode_records
from trainguard.detectors.stopped_job import StoppedConfig
from trainguard.infra.replay import read_recording
from trainguard.schemas.base import Event
from trainguard.schemas.control import ActionEvent, ActionPhase, stable_id
from trainguard.schemas.enums import Action
from trainguard.schemas.workload import ProcessExit, TrainingStep

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "incidents"
STOPPED_S = 30.0
CONFIG = replace(
    ReplayConfig(), monitor=MonitorConfig(stopped=StoppedConfig(stopped_s=STOPPED_S, recovery_silence_s=120))
)


def _recording() -> list[tuple[int, Event]]:
    events, rejected = decode_records(read_recording(FIXTURES / "crash.jsonl"))
    assert not rejected and events
    return events


def _until_stopped(events: list[tuple[int, Event]]) -> tuple[list[tuple[int, Event]], str, int]:
    """The recording up to the last rank exit (the restart never came), its job, that exit's time."""
    last_exit = max(ts for ts, ev in events if isinstance(ev, ProcessExit) and ev.rank >= 0)
    job = next(ev.job for _, ev in events if isinstance(ev, TrainingStep))
    return [(ts, ev) for ts, ev in events if ts <= last_exit], job, last_exit


def _action(job: str, decision: str, step: str, phase: ActionPhase, ts_ms: int) -> ActionEvent:
    return ActionEvent(
        event_id=stable_id(decision, step, phase.value, 0),
        decision_id=decision,
        ts_ms=ts_ms,
        job=job,
        step=step,
        phase=phase,
        action=Action.DIAGNOSE,
    )


def _run(events: list[tuple[int, Event]], until_ms: int) -> OfflinePipeline:
    pipeline = OfflinePipeline(CONFIG)
    for ts, ev in sorted(events, key=lambda pair: pair[0]):
        pipeline.feed(ts, ev)
    pipeline.advance(until_ms)
    return pipeline


def _stopped(pipeline: OfflinePipeline) -> list[str]:
    return [d.detection_id for d in pipeline.result.detections if d.kind == "stopped"]


def test_a_job_whose_recovery_failed_and_never_restarted_is_raised_as_a_restart_decision() -> None:
    events, job, last_exit = _until_stopped(_recording())
    failed_at = last_exit + 5_000
    events += [
        (last_exit - 1_000, _action(job, "rec-1", "recovery", ActionPhase.STARTED, last_exit - 1_000)),
        (failed_at, _action(job, "rec-1", "recovery", ActionPhase.FAILED, failed_at)),
    ]
    quiet_end = failed_at + int(STOPPED_S * 1000)
    early = _run(events, quiet_end - 2_000)
    assert _stopped(early) == []  # not before stopped_s after the recovery ended
    pipeline = _run(events, quiet_end + 3 * int(STOPPED_S * 1000))
    stopped = [d for d in pipeline.result.detections if d.kind == "stopped"]
    assert len(stopped) == 1  # one report per quiet period, however long it lasts
    det = stopped[0]
    assert det.job == job and det.action is Action.RESTART and det.category == "job_stopped"
    assert det.evidence["last_recovery"] == "rec-1" and det.evidence["last_recovery_state"] == "failed"
    assert 6 in det.evidence["dead_ranks"]
    assert det.ts_ms >= quiet_end
    restarts = [d for d in pipeline.result.decisions if d.action is Action.RESTART and d.job == job]
    assert len(restarts) == 1


def test_a_recovery_at_work_or_held_for_an_operator_explains_the_silence() -> None:
    events, job, last_exit = _until_stopped(_recording())
    running = [(last_exit, _action(job, "rec-2", "recovery", ActionPhase.STARTED, last_exit))]
    # Its last event within recovery_silence_s (120 s): still at work, however long the step.
    beat = last_exit + 100_000
    running.append((beat, _action(job, "rec-2", "restart", ActionPhase.STARTED, beat)))
    assert _stopped(_run(events + running, beat + 110_000)) == []
    # Silent for longer than that: the service is taken for gone and the job for stopped.
    assert len(_stopped(_run(events + running, beat + 125_000))) == 1

    held_at = last_exit + 4_000
    held = [
        (last_exit, _action(job, "rec-3", "recovery", ActionPhase.STARTED, last_exit)),
        (held_at, _action(job, "rec-3", "swap_standbys", ActionPhase.HELD, held_at)),
    ]
    assert _stopped(_run(events + held, held_at + 600_000)) == []


def test_with_no_recovery_event_at_all_a_dead_rank_makes_the_job_stopped() -> None:
    events, _job, last_exit = _until_stopped(_recording())
    last_step = max(ts for ts, ev in events if isinstance(ev, TrainingStep))
    assert _stopped(_run(events, last_step + int(STOPPED_S * 1000) - 3_000)) == []
    assert len(_stopped(_run(events, max(last_exit, last_step) + int(STOPPED_S * 1000) + 3_000))) == 1


def test_the_whole_recording_where_the_job_came_back_raises_nothing() -> None:
    events = _recording()
    pipeline = _run(events, max(ts for ts, _ in events))
    assert _stopped(pipeline) == []


def test_an_unseen_status_does_not_undo_the_clean_exit_a_launcher_reported() -> None:
    # Each rank's launcher reports its exit 0; the exporter, which did not start the ranks, notices
    # them gone a round later without a status.  The job finished: it is not a stopped job.
    def ended(rank: int, **status: object) -> ProcessExit:
        return ProcessExit(node="n1", ts_ms=61_000, pid=100 + rank, job="j", rank=rank, **status)

    unseen = {"reason": "process ended (exit status not visible to a non-parent)"}
    for order in ((0, 1), (1, 0)):
        m = JobMonitor("j", MonitorConfig(stopped=StoppedConfig(stopped_s=STOPPED_S)))
        for rank in (0, 1):
            m.on_step(TrainingStep(job="j", rank=rank, step=5, ts_ms=60_000), now_ms=60_000)
        for rank in (0, 1):
            reports = [
                ended(rank, exit_code=0, reason="exited with code 0, seen by its launcher"),
                ended(rank, **unseen),
            ]
            for i in order:
                m.on_exit(reports[i], now_ms=61_100)
        assert m.stopped.finished()
        assert [d.kind for d in m.check(now_ms=200_000)] == []
    # Without anyone's status, an ended rank still counts as failed.
    m = JobMonitor("j", MonitorConfig(stopped=StoppedConfig(stopped_s=STOPPED_S)))
    m.on_step(TrainingStep(job="j", rank=0, step=5, ts_ms=60_000), now_ms=60_000)
    m.on_exit(ended(0, **unseen), now_ms=61_100)
    assert not m.stopped.finished()
    assert [d.kind for d in m.check(now_ms=200_000)] == ["stopped"]
