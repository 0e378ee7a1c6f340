"""Issue #41: group memberships from the dump's ``pg_config`` over the command-line topology.

NCCL dumps list each process group's global ranks (as a string, ``"[0, 2, 4, 6]"``); a group the
topology's tp/pp/dp arithmetic does not know (a TP group of 4 when the command line said 2, an
expert-parallel group across data-parallel ranks) is judged on those ranks.  Built as JSON bytes in
PyTorch's format and read by :func:`parse_dump`, the path a real dump takes.
"""

from __future__ import annotations

import json
from typing import Any

from trainguard.detectors.flight_recorder import analyze_dumps, dump_time_ns, parse_dump, untimed_config
from trainguard.detectors.flight_recorder.analysis import FlightRecorderConfig
from trainguard.schemas.topology import JobTopology

S = 1_000_000_000
T0 = 1_800_000_000 * S
#: 8 ranks; the command line says TP 2 x DP 4 -- the dumps know better.
TOPO = JobTopology(job="j", tp=2, pp=1, dp=4, ranks_per_machine=4)
PG_CONFIG = {
    "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3, 4, 5, 6, 7]"},
    "tp_a": {"name": "tp_a", "desc": "TENSOR_MODEL_PARALLEL_GROUP", "ranks": "[0, 1, 2, 3]"},
    "tp_b": {"name": "tp_b", "desc": "TENSOR_MODEL_PARALLEL_GROUP", "ranks": "[4, 5, 6, 7]"},
    "ep_0": {"name": "ep_0", "desc": "EXPERT_MODEL_PARALLEL_GROUP", "ranks": "[0, 2, 4, 6]"},
}


def entry(group: str, seq: int, done: bool, at_s: float) -> dict[str, object]:
    created = T0 + int(at_s * S)
    return {
        "record_id": seq, "process_group": [group, PG_CONFIG[group]["desc"]], "collective_seq_id": seq,
        "p2p_seq_id": 0, "is_p2p": False, "profiling_name": "nccl:all_reduce",
        "state": "completed" if done else "started", "input_sizes": [[8]], "output_sizes": [[8]],
        "time_created_ns": created, "time_discovered_started_ns": created + 1000,
        "time_discovered_completed_ns": created + 2000 if done else 0,
    }  # fmt: skip


def dump(rank: int, entries: list[dict[str, object]]) -> bytes:
    return json.dumps({"version": "2.10", "pg_config": PG_CONFIG, "entries": entries}).encode()


def analyze(
    per_rank: dict[int, list[dict[str, object]]], cfg: FlightRecorderConfig | None = None
) -> dict[str, Any]:
    dumps = {r: parse_dump(dump(r, es), r, f"rank{r}") for r, es in per_rank.items()}
    when = dump_time_ns(dumps)
    assert when is not None
    config = cfg or untimed_config(FlightRecorderConfig())
    return analyze_dumps(dumps, TOPO, {r: when for r in dumps}, config).to_dict()


def tp(rank: int) -> str:
    return "tp_a" if rank < 4 else "tp_b"


def test_a_tp_group_of_four_comes_from_pg_config_not_from_the_command_line() -> None:
    # Rank 3 never enters #2 of its TP group of 4; the command line's TP 2 would put it in [2, 3].
    per = {
        r: [entry(tp(r), 1, True, 0), *([entry(tp(r), 2, False, 5)] if r in (0, 1, 2) else [])]
        for r in range(8)
    }
    out = analyze(per)
    assert out["verdict"] == "hang" and out["suspect_ranks"] == [3] and out["missing_ranks"] == [3]
    first = out["evidence"]["first_stuck"]
    assert first["members"] == [0, 1, 2, 3] and first["waiting"] == [0, 1, 2]


def test_two_ranks_missing_from_an_expert_parallel_group_are_both_suspects() -> None:
    # EP group [0, 2, 4, 6]: ranks 2 and 6 hang before #4; 0 and 4 wait in it for both.
    per: dict[int, list[dict[str, object]]] = {r: [entry(tp(r), 1, True, 0)] for r in range(8)}
    for r in (0, 2, 4, 6):
        per[r] += [entry("ep_0", 3, True, 1)]
    for r in (0, 4):
        per[r] += [entry("ep_0", 4, False, 2)]
    out = analyze(per)
    assert out["verdict"] == "hang"
    assert out["missing_ranks"] == [2, 6] and out["suspect_ranks"] == [2, 6]
    assert out["evidence"]["first_stuck"]["members"] == [0, 2, 4, 6]


def test_waits_are_measured_from_the_dumps_own_time() -> None:
    # The newest entry (rank 5's, 40 s in) times the dumps: rank 0 waited 30 s in #2, not since 1970.
    per = {
        r: [entry(tp(r), 1, True, 0), *([entry(tp(r), 2, False, 10)] if r in (0, 1, 2) else [])]
        for r in range(4)
    }
    per.update({r: [entry(tp(r), 1, True, 0), entry(tp(r), 2, True, 40)] for r in range(4, 8)})
    out = analyze(per, FlightRecorderConfig())  # min_stuck_s applies: 30 s is well over it
    assert out["verdict"] == "hang" and out["suspect_ranks"] == [3]
    assert 29.9 < out["evidence"]["first_stuck"]["waited_s"] < 30.1


def test_members_that_entered_but_never_started_are_slow_and_the_suspects() -> None:
    # TP group [0..3]: all entered #2; 0, 1, 3 started it (their kernels ran), 2's never started.
    per = {r: [entry(tp(r), 1, True, 0), entry(tp(r), 2, False, 5)] for r in range(4)}
    per[2][1]["state"] = "scheduled"
    per.update({r: [entry(tp(r), 1, True, 0)] for r in range(4, 8)})
    out = analyze(per)
    assert out["verdict"] == "hang" and out["suspect_ranks"] == [2] and out["missing_ranks"] == []
    assert out["evidence"]["first_stuck"]["slow"] == [2]
    assert "never started it (slow" in out["evidence"]["reason"]


def test_every_member_started_and_none_completed_names_no_culprit_rank() -> None:
    per = {r: [entry(tp(r), 1, True, 0), entry(tp(r), 2, False, 5)] for r in range(4)}
    per.update({r: [entry(tp(r), 1, True, 0)] for r in range(4, 8)})
    out = analyze(per)
    reason = out["evidence"]["reason"]
    assert (
        out["verdict"] == "hang"
        and out["missing_ranks"] == []
        and out["evidence"]["first_stuck"]["slow"] == []
    )
    assert reason.startswith("stuck collective in group TENSOR_MODEL_PARALLEL_GROUP, no culprit rank")
    # Not one member blamed: the whole group is the suspect (and its machine, the one it spans, goes).
    assert out["suspect_ranks"] == [0, 1, 2, 3]
