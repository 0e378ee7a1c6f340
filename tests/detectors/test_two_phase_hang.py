"""Two-phase hang detection: the capture starts at half the stall threshold, its verdict waits for
the threshold (issue 14: hangs were 40% of the demo's lost time; the stack capture alone took
about 2 s after the hang was called).

Through the pure detection path, as the worker's agents call it: steps, the training check, the
decide policy, the capture and its verdict.
"""

from __future__ import annotations

from trainguard.detectors.job_monitor import MonitorConfig
from trainguard.detectors.replay import ReplayConfig
from trainguard.detectors.routing import DetectionPath
from trainguard.detectors.training import StallConfig
from trainguard.schemas.control import Decision, Detection
from trainguard.schemas.enums import Action, ProcessRole
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.workload import (
    FlightRecorderDump,
    Frame,
    ProcessInfo,
    StackDump,
    ThreadStack,
    TrainingStep,
)

TOPO = JobTopology(job="j", machines=("m0", "m1"), tp=1, pp=1, dp=2, ranks_per_machine=1)
#: the demo's stall settings: 3 x p99 of the step time, within [2 s, 6 s].
STALL = StallConfig(stall_s=6.0, step_time_factor=3.0, min_stall_s=2.0, precapture_fraction=0.5)


def _path() -> DetectionPath:
    return DetectionPath(ReplayConfig(monitor=MonitorConfig(stall=STALL)))


def _train(path: DetectionPath, steps: range, step_ms: int = 400) -> None:
    for step in steps:
        for rank in range(2):
            ts = step * step_ms
            path.findings(
                "training",
                TrainingStep(
                    job="j", rank=rank, step=step, ts_ms=ts, node=f"m{rank}", step_time_s=step_ms / 1000
                ),
                ts,
            )


def _check(path: DetectionPath, now: int) -> list[Detection]:
    return path.check(now, now)


def _decide(path: DetectionPath, dets: list[Detection], now: int) -> list[Decision]:
    return [d for det in dets if (d := path.decide(det, now, TOPO)) is not None]


def _answer(path: DetectionPath, dec: Decision, hung_rank: int) -> str:
    """Both ranks' stacks: ``hung_rank`` sits in a collective the other has left."""
    (cap,) = [c for c in path.captures.pending.values() if c.decision_id == dec.decision_id]
    for rank in range(2):
        frames = (
            [Frame("all_reduce", "torch/distributed/distributed_c10d.py", 2000)]
            if rank == hung_rank
            else [Frame("sleep", "time.py", 1)]
        )
        path.add_dump(
            StackDump(
                job="j",
                node=f"m{rank}",
                rank=rank,
                pid=100 + rank,
                capture_id=cap.capture_id,
                ts_ms=0,
                role=ProcessRole.MAIN,
                process_tree=[ProcessInfo(pid=100 + rank)],
                threads=[ThreadStack(thread_id=1, name="MainThread", frames=frames)],
            )
        )
        # A job without a Flight Recorder: each rank's exporter says so (the stacks decide).
        path.add_fr_dump(
            FlightRecorderDump(
                job="j", node=f"m{rank}", rank=rank, ts_ms=0, capture_id=cap.capture_id,
                error="Flight Recorder not enabled in this rank (no reporter registration)",
            )
        )  # fmt: skip
    return cap.capture_id


def test_the_capture_starts_at_half_the_threshold_and_is_judged_at_the_threshold() -> None:
    path = _path()
    _train(path, range(1, 41))  # 0.4 s steps: threshold max(2 s, 3 x 0.4 s) = 2 s; last step 16 s
    assert _check(path, 16_900) == []  # 0.9 s: nothing yet
    (suspect,) = _check(path, 17_100)
    assert suspect.kind == "hang_suspect" and suspect.action is Action.AGGREGATE
    assert suspect.evidence["confirm_at_ms"] == 18_000
    (dec,) = _decide(path, [suspect], 17_100)
    assert dec.action is Action.AGGREGATE and dec.evidence["detection"]["confirm_at_ms"] == 18_000
    assert path.wants_capture(dec, 17_150)
    commands = path.start_capture(dec, TOPO, 17_150)
    assert len(commands) == 2  # one capture_stacks per machine
    cid = _answer(path, dec, hung_rank=1)
    assert path.captures.complete(cid)
    # Every answer is in by 17.6 s, but the stall is not a hang yet: the verdict waits.
    assert path.capture_wait_ms(cid, 17_600) == 400
    assert path.due_captures(17_600) == []
    # At the threshold the hang is reported too; its decision is the suspicion's (de-duplicated).
    (hang,) = _check(path, 18_050)
    assert hang.kind == "hang" and _decide(path, [hang], 18_050) == []
    (cap,) = path.due_captures(18_050)
    assert path.moot_capture(cap, 18_050) is None  # no step since the request: analyse it
    verdict = path.analyze(cap, 18_050)
    assert verdict.action is Action.EVICT and verdict.category == "job_hang"


def test_a_step_before_the_threshold_makes_the_early_capture_moot_and_clears_the_way() -> None:
    path = _path()
    _train(path, range(1, 41))
    (suspect,) = _check(path, 17_100)
    (dec,) = _decide(path, [suspect], 17_100)
    path.start_capture(dec, TOPO, 17_150)
    cid = _answer(path, dec, hung_rank=1)
    _train(path, range(41, 42), step_ms=420)  # a slow step at 17.22 s: the job was not hung
    (cap,) = path.due_captures(18_000)
    assert cap.capture_id == cid
    moot = path.moot_capture(cap, 18_000)
    assert moot is not None and moot.category == "healthy" and moot.action is Action.NONE
    assert _decide(path, [moot], 18_000) == []
    # A real hang right after: a new suspicion, decided, and captured (no window, no cooldown).
    _train(path, range(42, 45), step_ms=410)  # last step at 18.04 s
    (again,) = _check(path, 19_100)
    (dec2,) = _decide(path, [again], 19_100)
    assert dec2.decision_id != dec.decision_id and path.wants_capture(dec2, 19_150)


def test_no_early_capture_before_the_first_step_after_a_restart() -> None:
    """A restarted job's first step is slow (ranks start, load the checkpoint): only the full
    threshold applies until it has stepped once."""
    from trainguard.detectors.stopped_job import RecoveryStatus

    path = _path()
    _train(path, range(1, 41))
    status = RecoveryStatus()
    status.observe("d1", "stop", "started", ts=16.5)
    status.observe("d1", "recovery", "succeeded", ts=17.0)
    monitor = path.monitor("j")
    assert monitor.check(18_500, 18_500, status) == []  # 1.5 s after the restart: no suspicion
    (hang,) = monitor.check(19_050, 19_050, status)
    assert hang.kind == "hang"


def _suspected_and_answered(hung_rank: int) -> tuple[DetectionPath, Decision]:
    """40 steps of 0.4 s, a hang suspicion at 17.1 s, its decision, its capture (asked at 17.15 s)
    answered by both ranks: ``hung_rank`` inside a collective (-1: neither)."""
    path = _path()
    _train(path, range(1, 41))
    (suspect,) = _check(path, 17_100)
    (dec,) = _decide(path, [suspect], 17_100)
    path.start_capture(dec, TOPO, 17_150)
    _answer(path, dec, hung_rank)
    return path, dec


def test_a_hang_capture_waits_for_the_steps_a_lagging_worker_has_not_read() -> None:
    """Demo run 20261128-011805: a worker 8 s behind its input judged a job that stepped twice a
    second hung and evicted a healthy group.  The verdict now waits until the steps are read up
    to the moment it is judged for (``max_judge_lag_s`` at most)."""
    path, _ = _suspected_and_answered(hung_rank=1)
    # At 18.05 s the worker has read the steps up to 16.5 s only: not judged yet.
    assert path.due_captures(18_050, stream_now_ms=16_500) == []
    # The steps it had not read: the job moved on at 17.2 s.  Read, the capture is moot.
    _train(path, range(41, 43), step_ms=420)
    (cap,) = path.due_captures(18_300, stream_now_ms=18_100)
    moot = path.moot_capture(cap, 18_300)
    assert moot is not None and moot.category == "healthy"


def test_a_worker_that_never_catches_up_still_judges_after_max_judge_lag_s() -> None:
    path, _ = _suspected_and_answered(hung_rank=1)
    lag_ms = int(path.captures.config.max_judge_lag_s * 1000)
    assert path.due_captures(18_000 + lag_ms - 1, stream_now_ms=16_000) == []
    (cap,) = path.due_captures(18_000 + lag_ms, stream_now_ms=16_000)
    assert path.analyze(cap, 18_000 + lag_ms).action is Action.EVICT


def test_a_hang_refused_by_the_cooldown_is_captured_when_it_ends_if_still_stalled() -> None:
    """Demo run 20261128-004714: a capture of a step gap 5 s before the hang held the hang's own
    capture back by the cooldown; the hang was reported once and never captured."""
    path = _path()
    cooldown_ms = int(path.captures.config.cooldown_s * 1000)
    _train(path, range(1, 41))
    path.captures.last_capture_ms["j"] = 16_000  # a capture just judged (its stall cleared)
    (suspect,) = _check(path, 17_100)
    (dec,) = _decide(path, [suspect], 17_100)
    assert not path.wants_capture(dec, 17_150)
    assert path.deferred_captures(17_200) == []  # the cooldown still runs
    assert path.deferred_captures(16_000 + cooldown_ms) == [dec]  # over, no step since: capture
    assert path.deferred == {}
    assert len(path.start_capture(dec, TOPO, 16_000 + cooldown_ms)) == 2


def test_a_deferred_hang_is_dropped_once_the_job_steps_or_it_grows_old() -> None:
    path = _path()
    _train(path, range(1, 41))
    path.captures.last_capture_ms["j"] = 16_000
    (suspect,) = _check(path, 17_100)
    (dec,) = _decide(path, [suspect], 17_100)
    assert not path.wants_capture(dec, 17_150) and "j" in path.deferred
    _train(path, range(41, 42), step_ms=430)  # a step at 17.63 s: not hung
    assert path.deferred_captures(17_700) == [] and path.deferred == {}
    # Refused again, and then never allowed within defer_hang_s: forgotten.
    assert not path.wants_capture(dec, 17_750)
    path.monitors.clear()  # no monitor (its partition moved): only the age drops it
    old = dec.ts_ms + int(path.captures.config.defer_hang_s * 1000) + 1
    path.captures.last_capture_ms["j"] = old  # a capture of the job keeps the cooldown running
    assert path.deferred_captures(old) == [] and path.deferred == {}


def test_a_hang_capture_judged_healthy_lets_the_next_stall_be_decided_anew() -> None:
    """Demo run 20261128-042559: a capture judged healthy 6 s into a checkpoint hang (the ranks
    still moving into it) kept the stall's incident open, the hang reported 3 s later was merged
    into it, and the job waited 60 s for gloo's timeout."""
    path, dec = _suspected_and_answered(hung_rank=-1)  # nobody inside a collective: nothing to localise
    (cap,) = path.due_captures(18_050)
    assert path.moot_capture(cap, 18_050) is None
    verdict = path.analyze(cap, 18_050)
    assert verdict.category == "healthy" and verdict.evidence["stalled_since_ms"] == cap.stalled_since_ms
    assert _decide(path, [verdict], 18_050) == []  # on record; it ends the stall's incident
    _train(path, range(41, 42), step_ms=440)  # one more step (18.04 s), then the real hang
    (again,) = _check(path, 19_100)
    (dec2,) = _decide(path, [again], 19_100)
    assert dec2.decision_id != dec.decision_id and dec2.action is Action.AGGREGATE


def _decline(ts_ms: int) -> Decision:
    """An MFU decline's aggregate decision (a fail-slow capture: several rounds)."""
    detection = {"category": "mfu_decline", "kind": "mfu_decline", "ranks": [], "source_ts_ms": ts_ms}
    return Decision(
        decision_id=f"decline-{ts_ms}", ts_ms=ts_ms, job="j", action=Action.AGGREGATE,
        evidence={"detection": detection},
    )  # fmt: skip


def test_a_hang_suspicion_waits_for_the_fail_slow_capture_of_a_job_still_stepping() -> None:
    """Demo run 20261128-052330: a slow rank's long steps set off five hang suspicions in 80 s;
    each took the MFU decline's capture over and was judged moot, and the slow rank was never
    localised.  While the job steps, the fail-slow capture stays; the hang is deferred and
    dropped once the job has stepped since."""
    path = _path()
    _train(path, range(1, 41))
    decline = _decline(16_100)
    assert path.wants_capture(decline, 16_100)
    path.start_capture(decline, TOPO, 16_100)
    (slow,) = path.captures.pending.values()
    assert slow.rounds > 1
    _train(path, range(41, 42), step_ms=410)  # a step after the capture began (16.81 s)
    (suspect,) = _check(path, 18_100)
    (dec,) = _decide(path, [suspect], 18_100)
    assert not path.wants_capture(dec, 18_150) and "j" in path.deferred
    assert list(path.captures.pending.values()) == [slow]  # not taken over
    _train(path, range(42, 43), step_ms=440)  # 18.48 s: the job steps on, the hang is dropped
    assert path.deferred_captures(18_500) == [] and path.deferred == {}


def test_a_hang_still_takes_over_a_fail_slow_capture_once_the_job_stopped_stepping() -> None:
    path = _path()
    _train(path, range(1, 41))  # last step at 16 s
    decline = _decline(16_100)
    path.start_capture(decline, TOPO, 16_100)  # no step since: a stuck job's stacks decide
    (suspect,) = _check(path, 17_100)
    (dec,) = _decide(path, [suspect], 17_100)
    assert path.wants_capture(dec, 17_150)
    assert path.captures.pending == {}  # the fail-slow capture was dropped for the hang's


def test_a_decline_refused_while_a_hang_capture_is_open_is_captured_after_it() -> None:
    """The same run: the MFU decline was decided while a hang suspicion's capture was open,
    refused, and reported only once.  It is kept and captured when the hang's capture ends,
    without waiting the cooldown (a different condition)."""
    path, _ = _suspected_and_answered(hung_rank=-1)
    decline = _decline(17_300)
    assert not path.wants_capture(decline, 17_300) and "j" in path.deferred_slow
    assert path.deferred_captures(17_400) == []  # the hang's capture is still open
    _train(path, range(41, 42), step_ms=430)  # 17.63 s: the job stepped, the hang was moot
    (cap,) = path.due_captures(18_050)
    assert path.moot_capture(cap, 18_050) is not None
    assert path.deferred_captures(18_100) == [decline] and path.deferred_slow == {}
    path.start_capture(decline, TOPO, 18_100)
    (slow,) = path.captures.pending.values()
    assert slow.rounds == path.captures.config.fail_slow_rounds


def test_a_deferred_decline_is_forgotten_after_defer_slow_s() -> None:
    path, _ = _suspected_and_answered(hung_rank=-1)
    decline = _decline(17_300)
    assert not path.wants_capture(decline, 17_300)
    old = decline.ts_ms + int(path.captures.config.defer_slow_s * 1000) + 1
    assert path.deferred_captures(old) == [] and path.deferred_slow == {}


def _slow_capture_then_a_step_and_a_suspicion(path: DetectionPath) -> Decision:
    """A decline's capture opened at 16.1 s, a step at 16.81 s, then a hang suspicion at 18.1 s
    (deferred: the job stepped since the capture began)."""
    _train(path, range(1, 41))
    path.start_capture(_decline(16_100), TOPO, 16_100)
    _train(path, range(41, 42), step_ms=410)
    (suspect,) = _check(path, 18_100)
    (dec,) = _decide(path, [suspect], 18_100)
    assert not path.wants_capture(dec, 18_150) and "j" in path.deferred
    return dec


def test_a_deferred_suspicion_dropped_for_a_step_does_not_mute_the_next_hang() -> None:
    """Review of the change above: the dropped suspicion's incident stayed open, and a real hang
    within the incident's limit (300 s) was merged into it, undecided and uncaptured."""
    path = _path()
    _slow_capture_then_a_step_and_a_suspicion(path)
    _train(path, range(42, 45), step_ms=430)  # the job steps on (last step 18.92 s)
    assert path.deferred_captures(19_000) == [] and path.deferred == {}
    (hang,) = _check(path, 22_000)  # then stops: a real hang 3 s later
    (dec,) = _decide(path, [hang], 22_000)
    assert dec.action is Action.AGGREGATE


def test_a_deferred_hang_past_its_threshold_takes_over_the_fail_slow_capture() -> None:
    path = _path()
    dec = _slow_capture_then_a_step_and_a_suspicion(path)
    confirm_at = dec.evidence["detection"]["confirm_at_ms"]
    assert path.deferred_captures(confirm_at - 1) == []  # a suspicion still: the capture stays
    assert path.deferred_captures(confirm_at) == [dec]  # no step since: a hang, it takes over
    assert path.captures.pending == {}


def test_one_capture_per_job_and_tick_from_the_deferred_ones() -> None:
    """Review of the change above: a deferred hang and a deferred decline released in the same
    tick opened two captures of one job."""
    path = _path()
    _train(path, range(1, 41))
    path.captures.last_capture_ms["j"] = 16_000
    path.captures._last_was_hang["j"] = True  # a hang's capture just judged (its stall cleared)
    (suspect,) = _check(path, 17_100)
    (hang,) = _decide(path, [suspect], 17_100)
    assert not path.wants_capture(hang, 17_150)
    path.deferred_slow["j"] = _decline(17_200)
    end = 16_000 + int(path.captures.config.cooldown_s * 1000)
    assert path.deferred_captures(end) == [hang] and "j" in path.deferred_slow


def test_a_decline_after_a_hang_capture_judged_healthy_ignores_the_cooldown() -> None:
    """The cooldown holds between captures of one kind: a decline right after a hang's capture
    (here analysed and judged healthy, which keeps the cooldown running) is captured at once."""
    path, _ = _suspected_and_answered(hung_rank=-1)
    (cap,) = path.due_captures(18_050)
    assert path.moot_capture(cap, 18_050) is None
    assert path.analyze(cap, 18_050).category == "healthy"
    path.captures.analysing.pop("j", None)  # handed back, as the agent does after the verdict
    assert path.wants_capture(_decline(18_100), 18_100)


def test_a_recovery_starting_drops_the_deferred_captures() -> None:
    from trainguard.schemas.control import ActionEvent, ActionPhase

    path = _path()
    _slow_capture_then_a_step_and_a_suspicion(path)
    path.deferred_slow["j"] = _decline(18_200)
    path.on_action(
        ActionEvent(
            event_id="e1", decision_id="d1", job="j", ts_ms=18_300, step="recovery",
            phase=ActionPhase.STARTED,
        )
    )  # fmt: skip
    assert path.deferred == {} and path.deferred_slow == {}
