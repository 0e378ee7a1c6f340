"""The Flight Recorder analysis on hand-made dumps: each rule of the module docstring, one case each.
(Recorded dumps of real gloo jobs: ``test_flight_recorder_fixtures.py``.)"""

from __future__ import annotations

import pytest

from trainguard.detectors.flight_recorder import Entry, FlightRecorderConfig, Group, RankDump, analyze_dumps
from trainguard.schemas.topology import JobTopology

S = 1_000_000_000  # ns
NOW = 100 * S
TOPO = JobTopology(job="j", tp=2, pp=2, dp=1, ranks_per_machine=2)  # tp groups (0,1) (2,3); pp (0,2) (1,3)
GROUPS = {
    "0": Group("0", "default_pg", (0, 1, 2, 3)),
    "tp0": Group("tp0", "tp", (0, 1)),
    "tp1": Group("tp1", "tp", (2, 3)),
    "pp0": Group("pp0", "pp", (0, 2)),
    "pp1": Group("pp1", "pp", (1, 3)),
}


def e(group: str, seq: int, state: str = "completed", age_s: float = 50.0, op: str = "gloo:all_reduce",
      sizes: tuple[int, ...] = (4, 4), p2p: bool = False) -> Entry:  # fmt: skip
    return Entry(seq, group, seq, p2p, op, state, (sizes,), (sizes,), NOW - int(age_s * S), None)


def dumps(per_rank: dict[int, list[Entry]]) -> dict[int, RankDump]:
    return {r: RankDump(r, "2.10", GROUPS, tuple(es), f"rank{r}") for r, es in per_rank.items()}


def analyze(per_rank: dict[int, list[Entry]], **cfg: object) -> dict[str, object]:
    d = dumps(per_rank)
    return analyze_dumps(d, TOPO, {r: NOW for r in d}, FlightRecorderConfig(**cfg)).to_dict()  # type: ignore[arg-type]


def test_all_completed_is_healthy() -> None:
    out = analyze({r: [e("tp0" if r < 2 else "tp1", 1)] for r in range(4)})
    assert out["verdict"] == "healthy" and out["evict"]["kind"] is None


def test_a_collective_in_flight_for_less_than_min_stuck_is_healthy() -> None:
    # Rank 0 entered #2 half a second before its dump; rank 1 was dumped before it got there.
    out = analyze({0: [e("tp0", 1), e("tp0", 2, "scheduled", age_s=0.5)], 1: [e("tp0", 1)], 2: [], 3: []})
    assert out["verdict"] == "healthy"


def test_the_rank_that_never_entered_is_the_suspect_and_its_machine_is_evicted() -> None:
    out = analyze({0: [e("tp0", 1), e("tp0", 2, "scheduled", age_s=20)], 1: [e("tp0", 1)],
                   2: [e("tp1", 1)], 3: [e("tp1", 1)]})  # fmt: skip
    assert out["verdict"] == "hang"
    assert out["missing_ranks"] == [1] and out["suspect_ranks"] == [1]
    # Its pipeline [1, 3] spans both machines of this job: only the suspect's machine goes.
    evict = out["evict"]
    assert (evict["kind"], evict["ranks"], evict["machines"]) == ("machine", [0, 1], [0])
    assert evict["not_evicted"] == {"kind": "pp", "ranks": [1, 3]} and "every machine" in evict["why"]
    assert out["evidence"]["first_stuck"]["group"] == "tp0"
    # Allowed any share, a group that is the whole job still does not go.
    assert analyze({0: [e("tp0", 1), e("tp0", 2, "scheduled", age_s=20)], 1: [e("tp0", 1)],
                    2: [e("tp1", 1)], 3: [e("tp1", 1)]}, max_group_share=1.0)["evict"] == evict  # fmt: skip


def test_the_first_stuck_collective_is_the_cause_and_a_waiting_rank_is_not_a_root() -> None:
    # Rank 3 is stuck in compute.  Rank 2 waits for it in tp1 #2 (entered 30 s ago); rank 1 waits in
    # pp1 #1 (entered 20 s ago) for rank 3 too; rank 0 waits in tp0 #2 for rank 1 (10 s ago).
    out = analyze(
        {
            0: [e("tp0", 1), e("tp0", 2, "scheduled", age_s=10)],
            1: [e("tp0", 1), e("pp1", 1, "scheduled", age_s=20)],
            2: [e("tp1", 1), e("tp1", 2, "scheduled", age_s=30)],
            3: [e("tp1", 1)],
        }
    )
    assert out["evidence"]["first_stuck"]["group"] == "tp1"
    assert out["suspect_ranks"] == [3]
    assert [s["group"] for s in out["evidence"]["stuck"]] == ["tp1", "pp1", "tp0"]


def test_a_missing_rank_waiting_elsewhere_gives_way_to_an_idle_one() -> None:
    # default_pg #5: ranks 0 and 1 entered; 2 and 3 did not; 2 waits in pp0, 3 waits in nothing.
    out = analyze(
        {
            0: [e("0", 5, "scheduled", age_s=40)],
            1: [e("0", 5, "scheduled", age_s=40)],
            2: [e("0", 4), e("pp0", 1, "scheduled", age_s=30)],
            3: [e("0", 4)],
        }
    )
    assert out["missing_ranks"] == [2, 3] and out["suspect_ranks"] == [3]


def test_a_rank_without_a_dump_is_the_suspect_when_the_others_wait_on_it() -> None:
    out = analyze({0: [e("tp0", 1), e("tp0", 2, "started", age_s=15)], 2: [e("tp1", 1)], 3: [e("tp1", 1)]})
    assert out["verdict"] == "hang" and out["suspect_ranks"] == [1]
    assert out["evidence"]["undumped_ranks"] == [1]
    assert analyze({0: [e("tp0", 1), e("tp0", 2, "started", age_s=15)], 2: [], 3: []},
                   undumped_ranks_are_suspects=False)["suspect_ranks"] == []  # fmt: skip


def test_every_rank_inside_and_none_done_suspects_the_group() -> None:
    out = analyze(
        {0: [e("tp0", 3, "started", age_s=25)], 1: [e("tp0", 3, "started", age_s=25)], 2: [], 3: []}
    )
    assert out["verdict"] == "hang" and out["suspect_ranks"] == [0, 1] and out["missing_ranks"] == []
    assert out["evict"]["kind"] == "tp"
    assert "every rank entered it" in out["evidence"]["reason"]


def test_different_sizes_at_one_sequence_number_are_a_mismatch() -> None:
    out = analyze({0: [e("0", 7, "scheduled", sizes=(4, 4))], 1: [e("0", 7, "scheduled", sizes=(4, 4))],
                   2: [e("0", 7, "scheduled", sizes=(5, 4))], 3: [e("0", 7, "scheduled", sizes=(4, 4))]})  # fmt: skip
    assert out["verdict"] == "mismatch" and out["suspect_ranks"] == [2]
    assert out["evidence"]["mismatches"][0]["seq"] == 7


def test_p2p_entries_are_not_matched_as_collectives() -> None:
    out = analyze({0: [e("pp0", 1, op="gloo:send", p2p=True)], 2: [e("pp0", 1, op="gloo:recv", p2p=True)],
                   1: [], 3: []})  # fmt: skip
    assert out["verdict"] == "healthy"


def test_a_rank_whose_last_collective_was_with_a_dead_rank_waits_for_it() -> None:
    # Rank 1 died: rank 0's all-reduce with it failed (gloo retires it) and rank 0 sits idle;
    # rank 2 waits for rank 0 in pp0.  The dead rank, not the idle one, is the root.
    out = analyze({0: [e("tp0", 4, age_s=40)], 2: [e("pp0", 3, "scheduled", age_s=30)], 3: [e("tp1", 2)]})
    assert out["suspect_ranks"] == [1]
    assert "stopped after their last collective with them" in out["evidence"]["reason"]


GLOO = {"": Group("", "", ())}  # what gloo writes: no group lists its ranks


def _gloo(per_rank: dict[int, list[Entry]], topo: JobTopology) -> dict[str, object]:
    d = {r: RankDump(r, "2.10", GLOO, tuple(es), f"rank{r}") for r, es in per_rank.items()}
    return analyze_dumps(d, topo, {r: NOW for r in d}).to_dict()


def test_membership_is_inferred_from_the_topology_and_skips_size_one_dimensions() -> None:
    # tp2 pp2 dp1, gloo-style: group "A" is rank 0 and 1's TP group; rank 1 wrote no dump.
    topo = JobTopology(job="j", tp=2, pp=2, dp=1, ranks_per_machine=2)
    out = _gloo({0: [e("A", 1, "scheduled", age_s=30)], 2: [e("B", 1)], 3: [e("B", 1)]}, topo)
    assert out["suspect_ranks"] == [1] and out["evict"]["not_evicted"]["kind"] == "pp"  # the whole job


def test_a_dumped_member_without_entries_in_the_group_is_missing_from_it() -> None:
    # Group "A" is the DP group of ranks 0, 2, 4 and 6 in a tp2 pp1 dp4 job; 0, 2 and 4 are seen in it.
    topo = JobTopology(job="j", tp=2, pp=1, dp=4, ranks_per_machine=2)
    per = {r: [e("T", 1)] for r in range(8)}
    for r in (0, 2, 4):
        per[r] = per[r] + [e("A", 1, "scheduled", age_s=30)]
    out = _gloo(per, topo)  # rank 6 hung before its first collective in "A"
    assert out["suspect_ranks"] == [6] and out["missing_ranks"] == [6]


def test_uneven_all_to_all_sizes_are_not_a_mismatch() -> None:
    out = analyze({r: [e("0", 3, op="gloo:all_to_all", sizes=(r + 1, 4))] for r in range(4)})
    assert out["verdict"] == "healthy"


def test_a_tied_mismatch_suspects_every_rank_in_it() -> None:
    out = analyze({0: [e("0", 7, sizes=(4, 4))], 1: [e("0", 7, sizes=(4, 4))],
                   2: [e("0", 7, sizes=(5, 4))], 3: [e("0", 7, sizes=(5, 4))]})  # fmt: skip
    assert out["verdict"] == "mismatch" and out["suspect_ranks"] == [0, 1, 2, 3]


def test_the_eviction_preference_is_checked_like_the_stack_analysis() -> None:
    with pytest.raises(ValueError, match="unknown kind"):
        FlightRecorderConfig(evict_preference=("pp", "ep"))


def test_a_listless_group_inside_a_dp_group_with_a_sibling_is_its_own_ranks() -> None:
    """Issue #41: expert-parallel groups on gloo (whose pg_config lists no ranks).  EP groups "E0"
    [0, 2] and "E1" [4, 6] split the DP group [0, 2, 4, 6]; rank 2 never enters E0 #2.  Ranks 4 and
    6 are in E1, not missing from E0: rank 2 alone is."""
    topo = JobTopology(job="j", tp=2, pp=1, dp=4, ranks_per_machine=2)
    per = {r: [e("T", 1)] for r in range(8)}
    for r in (0, 2):
        per[r] = per[r] + [e("E0", 1)]
    for r in (4, 6):
        per[r] = per[r] + [e("E1", 1), e("E1", 2)]
    per[0] = per[0] + [e("E0", 2, "scheduled", age_s=30)]
    out = _gloo(per, topo)
    assert out["verdict"] == "hang" and out["suspect_ranks"] == [2] and out["missing_ranks"] == [2]
    assert out["evidence"]["first_stuck"]["members"] == [0, 2]


def test_a_one_rank_group_is_no_sibling_a_rank_that_never_entered_stays_missing() -> None:
    # tp 1 jobs record collectives in one-rank groups ("S6" of rank 6): that is no expert split of
    # the DP group [0, 2, 4, 6]; rank 6, hung before its first "A" collective, is still missing.
    topo = JobTopology(job="j", tp=2, pp=1, dp=4, ranks_per_machine=2)
    per = {r: [e("T", 1)] for r in range(8)}
    for r in (0, 2, 4):
        per[r] = per[r] + [e("A", 1, "scheduled", age_s=30)]
    per[6] = per[6] + [e("S6", 1)]
    out = _gloo(per, topo)
    assert out["suspect_ranks"] == [6] and out["missing_ranks"] == [6]
