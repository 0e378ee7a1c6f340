"""The stacks' verdict and the Flight Recorder's, combined into one over-eviction decision: the
recorder's side comes from real gloo dumps (a rank hung computing: rank 5 of tp2pp2dp2), the
stacks' side from each case's verdict; and a capture that got both, judged end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainguard.detectors.capture import Capture
from trainguard.detectors.flight_recorder import analyze_dumps, dump_to_event, load_dump_dir
from trainguard.detectors.flight_recorder.combine import combine
from trainguard.detectors.stacks.result import Evidence, OverEvictionResult
from trainguard.schemas.enums import Action, ProcessRole, Verdict
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.workload import FlightRecorderDump, Frame, ProcessInfo, StackDump, ThreadStack

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "flight_recorder"
TOPO = JobTopology(job="j", tp=2, pp=2, dp=2, ranks_per_machine=2, machines=["m0", "m1", "m2", "m3"])
PREF = ("pp", "tp", "dp")


def _fr(name: str):  # type: ignore[no-untyped-def]
    manifest = json.loads((FIXTURES / name / "manifest.json").read_text())
    dumps = load_dump_dir(FIXTURES / name / "pickle")
    dump_ns = {int(r): ns for r, ns in manifest["dumped_at_ns"]["pickle"].items()}
    return analyze_dumps(dumps, TOPO, dump_ns), dumps, dump_ns


HANG, _, _ = _fr("tp2pp2dp2_compute_hang")  # suspect 5, its pp group [1, 5]
HEALTHY, _, _ = _fr("tp2pp2dp2_healthy")


def _stacks(verdict: Verdict, suspects: tuple[int, ...] = (), kind: str | None = None) -> OverEvictionResult:
    ranks = tuple(TOPO.group(kind, suspects[0])) if kind else ()  # type: ignore[arg-type]
    ev = Evidence(reason="stacks", analysis="hang", rounds=1, cause="", root_reach=1.0, missing_ranks=())
    return OverEvictionResult(verdict, suspects, kind, ranks, tuple(TOPO.machines_of(list(ranks))), ev)


def test_the_fixture_names_rank_5() -> None:
    assert HANG.verdict == "hang" and HANG.suspect_ranks == (5,) and HANG.evict_ranks == (1, 5)


def test_without_dumps_the_stacks_decide() -> None:
    c = combine(_stacks(Verdict.HANG, (5,), "pp"), None, TOPO, PREF)
    assert (c.decided_by, c.evict_ranks) == ("stacks", (1, 5))


def test_a_recorder_with_nothing_stuck_leaves_the_stacks_verdict() -> None:
    c = combine(_stacks(Verdict.HANG, (2,), "pp"), HEALTHY, TOPO, PREF)
    assert (c.decided_by, c.evict_ranks) == ("stacks", (2, 6)) and "no stuck collective" in c.reason
    c = combine(_stacks(Verdict.HEALTHY), HEALTHY, TOPO, PREF)
    assert c.verdict is Verdict.HEALTHY and not c.evict_ranks and "neither witness" in c.reason


def _with_classes(result: OverEvictionResult, *classes: tuple[str, tuple[int, ...]]) -> OverEvictionResult:
    """``result`` whose stacks showed these (role, ranks) classes of main processes."""
    from dataclasses import replace

    from trainguard.detectors.stacks.result import StackClass

    cls = tuple(StackClass("main", role, ranks, ("f (x.py)",), suspect=False) for role, ranks in classes)
    return replace(result, evidence=replace(result.evidence, classes=cls))


def test_ranks_in_collectives_that_the_recorder_shows_completing_are_not_a_hang() -> None:
    # Seen in a demo run under load: rank 2 deep-copying its checkpoint, the others in their
    # all-reduce -- which every rank's recorder showed had not been waiting long.
    stacks = _with_classes(_stacks(Verdict.HANG, (2,), "pp"), ("compute", (2,)), ("collective", (0, 1, 3)))
    assert not HEALTHY.undumped_ranks
    c = combine(stacks, HEALTHY, TOPO, PREF)
    assert c.verdict is Verdict.HEALTHY and not c.evict_ranks and c.decided_by == "flight_recorder"
    assert "not a hang" in c.reason and "[0, 1, 3]" in c.reason


def test_waits_the_recorder_cannot_see_keep_the_stacks_verdict() -> None:
    # Ranks waiting in p2p only (gloo's recorder has no p2p entries): the stacks decide.
    stacks = _with_classes(_stacks(Verdict.HANG, (2,), "pp"), ("compute", (2,)), ("p2p", (6,)))
    assert combine(stacks, HEALTHY, TOPO, PREF).evict_ranks == (2, 6)
    # A rank whose recorder did not answer could be the one stuck: the stacks decide.
    from dataclasses import replace

    partial = replace(HEALTHY, undumped_ranks=(3,))
    stacks = _with_classes(_stacks(Verdict.HANG, (2,), "pp"), ("collective", (0, 1)))
    assert combine(stacks, partial, TOPO, PREF).evict_ranks == (2, 6)


def test_the_recorder_decides_when_the_stacks_name_no_group() -> None:
    c = combine(_stacks(Verdict.HEALTHY), HANG, TOPO, PREF)
    assert c.verdict is Verdict.HANG and c.decided_by == "flight_recorder"
    assert (c.evict_kind, c.evict_ranks, c.evict_machines, c.suspect_ranks) == ("pp", (1, 5), (0, 2), (5,))


def test_agreeing_witnesses_keep_the_stacks_group() -> None:
    c = combine(_stacks(Verdict.HANG, (5,), "pp"), HANG, TOPO, PREF)
    assert (c.decided_by, c.evict_kind, c.evict_ranks) == ("both", "pp", (1, 5))


def test_the_recorders_group_when_it_holds_the_stacks_suspects() -> None:
    # The stacks blame rank 1 (its tp group [0, 1]); rank 1 is in the recorder's pp group [1, 5].
    c = combine(_stacks(Verdict.HANG, (1,), "tp"), HANG, TOPO, PREF)
    assert (c.decided_by, c.evict_kind, c.evict_ranks, c.suspect_ranks) == ("both", "pp", (1, 5), (1, 5))


def test_disagreeing_witnesses_evict_the_group_holding_both() -> None:
    # Stacks: rank 4 (pp [0, 4]); recorder: rank 5 (pp [1, 5]); tp group [4, 5] holds both.
    c = combine(_stacks(Verdict.HANG, (4,), "pp"), HANG, TOPO, PREF)
    assert (c.decided_by, c.evict_kind, c.evict_ranks) == ("union", "tp", (4, 5))


def test_with_no_group_holding_both_the_stacks_decide() -> None:
    c = combine(_stacks(Verdict.HANG, (2,), "pp"), HANG, TOPO, PREF)
    assert (c.decided_by, c.evict_ranks) == ("stacks", (2, 6)) and "disagree" in c.reason


def test_fail_slow_is_the_stacks_alone() -> None:
    c = combine(_stacks(Verdict.FAIL_SLOW, (2,), "pp"), HANG, TOPO, PREF)
    assert (c.verdict, c.decided_by, c.evict_ranks) == (Verdict.FAIL_SLOW, "stacks", (2, 6))


def _idle_stacks(cap: Capture) -> None:
    """Every rank's main process asleep outside any collective: the stacks name no one."""
    for rank in range(TOPO.world_size):
        cap.add(
            StackDump(
                job="j", node=TOPO.machine_name(TOPO.machine_of(rank)), rank=rank, pid=100 + rank,
                capture_id=cap.capture_id, ts_ms=0, role=ProcessRole.MAIN,
                process_tree=[ProcessInfo(pid=100 + rank)],
                threads=[ThreadStack(thread_id=1, name="MainThread", frames=[Frame("sleep", "time.py", 1)])],
            )
        )  # fmt: skip


def test_a_capture_with_recorder_dumps_evicts_what_they_show() -> None:
    _, dumps, dump_ns = _fr("tp2pp2dp2_compute_hang")
    cap = Capture("c1", "j", TOPO, rounds=1, deadline_ms=10, requested_ms=0, flight_recorder=True)
    _idle_stacks(cap)
    for rank, d in dumps.items():
        node = TOPO.machine_name(TOPO.machine_of(rank))
        cap.add_fr(dump_to_event(d, job="j", node=node, ts_ms=dump_ns[rank] // 1_000_000, capture_id="c1"))
    det = cap.analyze(1_000)
    assert det.action is Action.EVICT and det.category == "job_hang"
    analysis = det.evidence
    assert analysis["decided_by"] == "flight_recorder"
    assert analysis["evict"]["machine_names"] == ["m0", "m2"]
    assert analysis["flight_recorder"]["used"] and analysis["flight_recorder"]["suspect_ranks"] == [5]
    assert "Flight Recorder" in det.message or "flight recorder" in det.message


@pytest.mark.parametrize(
    ("error", "used"),
    [("Flight Recorder not enabled in this rank (no reporter registration)", False), ("", True)],
)
def test_a_rank_without_a_recorder_takes_the_recorder_out(error: str, used: bool) -> None:
    _, dumps, dump_ns = _fr("tp2pp2dp2_compute_hang")
    cap = Capture("c1", "j", TOPO, rounds=1, deadline_ms=10, requested_ms=0, flight_recorder=True)
    _idle_stacks(cap)
    for rank, d in dumps.items():
        ts = dump_ns[rank] // 1_000_000
        if rank == 3 and error:
            cap.add_fr(FlightRecorderDump(job="j", node="m1", rank=3, ts_ms=ts, capture_id="c1", error=error))
        else:
            cap.add_fr(dump_to_event(d, job="j", node="m", ts_ms=ts, capture_id="c1"))
    det = cap.analyze(1_000)
    analysis = det.evidence
    assert analysis["flight_recorder"]["used"] is used
    assert (det.action is Action.EVICT) is used  # without the recorder, idle stacks evict no one


def test_a_fast_jobs_stall_threshold_shortens_what_counts_as_stuck() -> None:
    _, dumps, dump_ns = _fr("tp2pp2dp2_compute_hang")
    cap = Capture(
        "c1", "j", TOPO, rounds=1, deadline_ms=10, requested_ms=0, flight_recorder=True, stall_threshold_s=2.0
    )
    for rank, d in dumps.items():
        cap.add_fr(dump_to_event(d, job="j", node="m", ts_ms=dump_ns[rank] // 1_000_000, capture_id="c1"))
    _, info = cap.flight_recorder_result()
    assert info["min_stuck_s"] == 0.8  # 0.4 x the 2 s threshold, under the 3 s default


def test_a_capture_is_ready_only_with_every_recorder_answer_or_at_its_deadline() -> None:
    cap = Capture("c1", "j", TOPO, rounds=1, deadline_ms=10_000, requested_ms=0, flight_recorder=True)
    _idle_stacks(cap)
    assert cap.fr_missing() == list(range(8)) and not cap.ready(1_000)
    for rank in range(8):
        cap.add_fr(FlightRecorderDump(job="j", node="m", rank=rank, ts_ms=1, capture_id="c1", error="x"))
    assert cap.ready(1_000)
    late = Capture("c2", "j", TOPO, rounds=1, deadline_ms=10_000, requested_ms=0, flight_recorder=True)
    _idle_stacks(late)
    assert late.ready(10_000)  # the deadline: missing answers are evidence, not a reason to wait


def test_the_recorder_alone_needs_the_full_wait() -> None:
    """A fast job's capture counts collectives as stuck sooner, to corroborate the stacks; on its
    own the recorder decides only once its stuck collective waited the full min_stuck_s."""
    waited = HANG.stuck[0].waited_s
    c = combine(_stacks(Verdict.HEALTHY), HANG, TOPO, PREF, alone_min_stuck_s=waited + 1)
    assert c.decided_by == "stacks" and not c.evict_ranks and "waits for more" in c.reason
    c = combine(_stacks(Verdict.HEALTHY), HANG, TOPO, PREF, alone_min_stuck_s=waited - 0.1)
    assert c.decided_by == "flight_recorder" and c.evict_ranks == (1, 5)
    # Corroborating the stacks needs no more than the shorter bar.
    c = combine(_stacks(Verdict.HANG, (5,), "pp"), HANG, TOPO, PREF, alone_min_stuck_s=waited + 1)
    assert c.decided_by == "both"


def test_a_capture_judged_slow_not_hung_lets_the_next_hang_capture_skip_the_cooldown_once() -> None:
    from trainguard.detectors.capture import AggregationConfig, Captures
    from trainguard.schemas.control import Decision, Detection

    caps = Captures(AggregationConfig(cooldown_s=60.0))

    def ask(n: int, at: int):  # type: ignore[no-untyped-def]
        dec = Decision(
            decision_id=f"d{n}", ts_ms=at, job="j", action=Action.AGGREGATE,
            evidence={"detection": {"category": "job_hang", "kind": "hang_suspect"}},
        )  # fmt: skip
        return caps.start(dec, TOPO, at)

    def judged(cap, verdict: str, decided_by: str) -> None:  # type: ignore[no-untyped-def]
        caps.pending.pop(cap.capture_id)
        det = Detection(
            detection_id=f"v-{cap.capture_id}", ts_ms=0, job="j", kind="over_eviction", category="healthy",
            evidence={"verdict": verdict, "decided_by": decided_by, "evidence": {}},
        )  # fmt: skip
        assert caps.extend(cap, det, 0) == []

    first = ask(1, 1_000)
    judged(first, "healthy", "flight_recorder")  # the recorder: slow, not hung
    assert caps.wants("j", 5_000, hang=True)  # 4 s later, not 60: look again
    second = ask(2, 5_000)
    assert second.recheck
    judged(second, "healthy", "flight_recorder")  # slow again: now the cooldown holds
    assert not caps.wants("j", 10_000, hang=True)
    assert caps.wants("j", 66_000, hang=True)
    third = ask(3, 66_000)
    judged(third, "healthy", "stacks")  # any other healthy verdict: the cooldown holds
    assert not third.recheck and not caps.wants("j", 70_000, hang=True)
