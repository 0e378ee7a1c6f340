"""A close fail-slow vote asks the same capture for more rounds before anything is evicted
(detectors/capture.py, through the detection path the worker and the replay share)."""

from __future__ import annotations

from tests.detectors.test_over_eviction import COMPUTE, DP_SYNC, RECV_BWD, RECV_FWD, Stack
from trainguard.detectors.replay import ReplayConfig
from trainguard.detectors.routing import DetectionPath
from trainguard.schemas.control import Command, Decision, Detection
from trainguard.schemas.enums import Action
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.workload import Frame, StackDump, ThreadStack

#: tp1 pp2 dp4: rank = dp + 4 * pp; rank 6 = dp2, last stage; its pipeline is (2, 6).
TOPO = JobTopology(job="j", tp=1, pp=2, dp=4, ranks_per_machine=1, machines=[f"m{i}" for i in range(8)])
SLOW = 6


def _stack(rank: int, slow: int | None) -> Stack:
    """``slow`` computes, its pipeline peer waits on it, the other replicas wait in the DP sync."""
    if rank == slow:
        return COMPUTE
    if slow is not None and rank % 4 == slow % 4:
        return RECV_BWD if rank < 4 else RECV_FWD
    return DP_SYNC


def _dumps(capture_id: str, rnd: int, slow: int | None) -> list[StackDump]:
    return [
        StackDump(
            job="j",
            node=f"m{r}",
            rank=r,
            pid=100 + r,
            capture_id=capture_id,
            ts_ms=6_000 + rnd,
            round=rnd,
            threads=[
                ThreadStack(name="MainThread", frames=[Frame(fn, path, 10) for fn, path in _stack(r, slow)])
            ],
        )
        for r in range(TOPO.world_size)
    ]


def _straggler(ranks: tuple[int, ...], category: str) -> Detection:
    return Detection(
        detection_id=f"d-{category}", ts_ms=5_000, job="j", kind=category, category=category,
        action=Action.AGGREGATE, ranks=list(ranks), source_ts_ms=5_000,
    )  # fmt: skip


def _capture(path: DetectionPath, det: Detection) -> str:
    dec = path.decide(det, 5_000)
    assert dec is not None and path.wants_capture(dec, 5_000)
    cmds = [c for c in path.start_capture(dec, TOPO, 5_000) if isinstance(c, Command)]
    assert {c.args["rounds"] for c in cmds} == {5} and "first_round" not in cmds[0].args
    return str(cmds[0].args["capture_id"])


def _answer(path: DetectionPath, cid: str, slows: list[int | None], first: int = 0) -> None:
    for i, slow in enumerate(slows):
        for d in _dumps(cid, first + i, slow):
            assert path.add_dump(d)


def test_a_close_vote_takes_more_rounds_then_evicts() -> None:
    path = DetectionPath(ReplayConfig())
    cid = _capture(path, _straggler((), "mfu_decline"))  # no rank named: any of 8 could win
    # Rank 6 the root in 3 of 5 rounds: p = 8 * P[Bin(5, 1/8) >= 3] = 0.13, close, not enough.
    _answer(path, cid, [SLOW, None, SLOW, None, SLOW])
    (cap,) = path.due_captures(7_000)
    det = path.analyze(cap, 7_000)
    assert det.action is Action.NONE and det.evidence["evidence"]["more_rounds"] == 5
    more = path.extend_capture(cap, det, 7_000)
    assert sorted(c.node for c in more) == TOPO.machines
    assert {(c.args["rounds"], c.args["first_round"], c.args["capture_id"]) for c in more} == {(5, 5, cid)}
    assert len({c.command_id for c in more}) == 8  # not the first commands' ids: not de-duplicated
    assert path.due_captures(7_001) == []  # waiting for the new rounds
    _answer(path, cid, [SLOW, SLOW, None, SLOW, SLOW], first=5)
    (cap,) = path.due_captures(8_000)  # complete: all 10 rounds answered
    det = path.analyze(cap, 8_000)
    assert det.action is Action.EVICT and det.category == "fail_slow", det.message
    assert det.evidence["evict"]["ranks"] == [2, 6] and det.evidence["evidence"]["rounds"] == 10
    assert det.evidence["evidence"]["p_value"] <= 0.01
    assert path.extend_capture(cap, det, 8_000) == []


def test_the_straggler_signals_rank_needs_less_evidence() -> None:
    path = DetectionPath(ReplayConfig())
    cid = _capture(path, _straggler((SLOW,), "straggler"))
    _answer(path, cid, [SLOW, SLOW, None, SLOW, SLOW])
    (cap,) = path.due_captures(7_000)
    assert cap.hint == (SLOW,)
    det = path.analyze(cap, 7_000)
    assert det.action is Action.EVICT and det.evidence["evidence"]["hint"] == [SLOW]
    # Tested alone: (1/8)^4 (4 rounds with rank 6 the root; any of the 8 ranks: 8 times that).
    assert abs(det.evidence["evidence"]["p_value"] - 0.125**4) < 1e-6
    assert path.extend_capture(cap, det, 7_000) == []


def test_a_tied_rank_the_signal_did_not_name_is_not_evicted_on_its_bar() -> None:
    """Rank 6 (named) and rank 1 (not, another pipeline) tie: only rank 6's group may go."""
    path = DetectionPath(ReplayConfig())
    cid = _capture(path, _straggler((SLOW,), "straggler"))
    _answer(path, cid, [SLOW, 1, SLOW, 1, SLOW, 1, SLOW, 1, None, None][:5])
    (cap,) = path.due_captures(7_000)
    det = path.analyze(cap, 7_000)
    assert det.evidence["suspect_ranks"] in ([SLOW], []), det.evidence["evidence"]["reason"]
    assert 1 not in det.evidence["evict"]["ranks"]


def test_a_hang_takes_over_a_pending_fail_slow_capture() -> None:
    path = DetectionPath(ReplayConfig())
    _capture(path, _straggler((), "mfu_decline"))
    hang = path.decide(
        Detection(detection_id="d-hang", ts_ms=6_000, job="j", kind="hang", category="job_hang",
                  action=Action.AGGREGATE, source_ts_ms=6_000),
        6_000,
    )  # fmt: skip
    assert hang is not None and path.wants_capture(hang, 6_000)  # no cooldown, no waiting
    cmds = [c for c in path.start_capture(hang, TOPO, 6_000) if isinstance(c, Command)]
    assert {c.args["rounds"] for c in cmds} == {1}
    assert [c.rounds for c in path.captures.pending.values()] == [1]


def test_no_new_capture_while_one_is_analysed_and_the_cooldown_counts_from_more_rounds() -> None:
    path = DetectionPath(ReplayConfig())
    cid = _capture(path, _straggler((), "mfu_decline"))
    _answer(path, cid, [SLOW, None, SLOW, None, SLOW])
    (cap,) = path.due_captures(7_000)
    again = Decision(
        decision_id="dec-again", ts_ms=7_001, job="j", action=Action.AGGREGATE,
        evidence={"detection": {"category": "mfu_decline"}},
    )  # fmt: skip
    assert not path.wants_capture(again, 65_500)  # the cooldown is over, but it is being analysed
    assert path.extend_capture(cap, path.analyze(cap, 7_000), 7_000)
    assert path.captures.last_capture_ms["j"] == 7_000
    assert not path.wants_capture(again, 7_000 + 30_000)  # pending again


def test_more_rounds_nobody_answers_leave_the_verdict_healthy() -> None:
    path = DetectionPath(ReplayConfig())
    cid = _capture(path, _straggler((), "mfu_decline"))
    _answer(path, cid, [SLOW, None, SLOW, None, SLOW])
    (cap,) = path.due_captures(7_000)
    assert path.extend_capture(cap, path.analyze(cap, 7_000), 7_000)
    (cap,) = path.due_captures(7_000 + 80_000)  # the deadline: the exporters never answered
    det = path.analyze(cap, 87_000)
    assert det.action is Action.NONE and det.evidence["evidence"]["rounds"] == 5
    assert path.extend_capture(cap, det, 87_000) == []  # judged: not asked again


def test_a_healthy_capture_is_judged_without_more_rounds() -> None:
    path = DetectionPath(ReplayConfig())
    cid = _capture(path, _straggler((), "mfu_decline"))
    _answer(path, cid, [None] * 5)  # everyone in the DP sync: no root at all
    (cap,) = path.due_captures(7_000)
    det = path.analyze(cap, 7_000)
    assert det.action is Action.NONE and det.evidence["evidence"]["more_rounds"] == 0
    assert path.extend_capture(cap, det, 7_000) == []
