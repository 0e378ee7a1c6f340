"""The placement planner: groups over machine slots, standby choice (exact and heuristic), pool."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.detectors.placement import (
    Groups,
    PlacementConfig,
    choose_replacements,
    first_free,
    measure,
    place_standbys,
    uncovered_pods,
)
from trainguard.detectors.placement.replace import Replacement
from trainguard.schemas.network import MachinePosition as P
from trainguard.schemas.topology import JobTopology

EXACT = PlacementConfig(exact_nodes=10_000_000)
HEURISTIC = PlacementConfig(exact_nodes=0)


@settings(max_examples=60, deadline=None)
@given(
    tp=st.integers(1, 3),
    pp=st.integers(1, 4),
    dp=st.integers(1, 4),
    rpm=st.integers(1, 8),
    order=st.sampled_from(["tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "pp-dp-tp"]),
)
def test_machine_groups_are_the_rank_groups_machines(tp: int, pp: int, dp: int, rpm: int, order: str) -> None:
    t = JobTopology(job="j", tp=tp, pp=pp, dp=dp, ranks_per_machine=rpm, order=order)
    g = Groups.of(t)
    assert g.n_slots == t.num_machines
    assert g.dp == tuple(sorted({tuple(t.machines_of(r)) for r in t.groups("dp")}))
    assert g.pp == tuple(sorted({tuple(t.machines_of(r)) for r in t.groups("pp")}))


def _job(pods: list[str]) -> tuple[list[str], dict[str, P]]:
    machines = [f"m{i}" for i in range(len(pods))]
    return machines, {m: P(p, "r1") for m, p in zip(machines, pods, strict=True)}


def test_a_standby_in_the_leaving_machines_pod_wins_over_the_first_in_the_pool() -> None:
    # DP groups {0,1} in pod a and {2,3} in pod b; PP groups {0,2} and {1,3}.
    g = Groups.explicit(4, dp=[[0, 1], [2, 3]], pp=[[0, 2], [1, 3]])
    machines, pos = _job(["a", "a", "b", "b"])
    pos |= {"s-b": P("b", "r1"), "s-a": P("a", "r2")}
    r = choose_replacements(machines, g, ["m1"], ["s-b", "s-a"], pos, EXACT)
    assert r.chosen == ("s-a",) and r.method == "exact"
    assert (r.before.dp, r.after.dp, r.before.pp, r.after.pp) == (1, 1, 2, 2)
    ff = choose_replacements(machines, g, ["m1"], ["s-b", "s-a"], pos, PlacementConfig(enabled=False))
    assert ff.chosen == ("s-b",) and ff.method == "first_free" and ff.after.dp == 2


def test_over_evicting_a_pipeline_gives_each_stage_a_standby_of_its_own_pod() -> None:
    t = JobTopology(job="j", tp=8, pp=4, dp=6, ranks_per_machine=8)  # machine = dp + 6 * pp
    g = Groups.of(t)
    machines = [f"m{i:02d}" for i in range(t.num_machines)]
    pos = {m: P(f"pod{i // 6}", f"r{i % 2}") for i, m in enumerate(machines)}
    pool = [f"s{i}" for i in range(6)]
    pos |= {s: P(f"pod{3 - i % 4}", "r9") for i, s in enumerate(pool)}  # s0: pod3, s1: pod2, ...
    pipeline = [machines[2 + 6 * p] for p in range(4)]  # stage p in pod p
    r = choose_replacements(machines, g, pipeline, pool, pos, EXACT)
    assert [pos[s].pod for s in r.chosen] == ["pod0", "pod1", "pod2", "pod3"]
    assert r.after.dp == 1 and r.method == "exact"
    first = dict(zip(pipeline, first_free(pool, 4), strict=True))
    assert measure([first.get(m, m) for m in machines], g, pos).dp == 2


def test_ready_standbys_come_first_even_from_another_pod() -> None:
    g = Groups.explicit(2, dp=[[0, 1]], pp=[[0], [1]])
    machines, pos = _job(["a", "a"])
    pos |= {"near": P("a", "r1"), "far": P("b", "r1")}
    r = choose_replacements(machines, g, ["m0"], ["near", "far"], pos, EXACT, prefer={"far"})
    assert r.chosen == ("far",) and r.key[0] == 0
    r = choose_replacements(machines, g, ["m0"], ["near", "far"], pos, EXACT, prefer={"far", "near"})
    assert r.chosen == ("near",)


def test_racks_then_names_break_ties() -> None:
    g = Groups.explicit(3, dp=[[0, 1, 2]], pp=[[0], [1], [2]])
    machines = ["x", "y", "z"]
    pos = {"x": P("a", "r1"), "y": P("a", "r1"), "z": P("a", "r2")}
    pos |= {"s3": P("a", "r1"), "s2": P("a", "r7"), "s1": P("a", "r1")}
    r = choose_replacements(machines, g, ["z"], ["s2", "s3", "s1"], pos, EXACT)
    assert r.chosen == ("s1",)  # rack r1 (already in the group) over r7; s1 before s3 by name


def test_no_known_position_keeps_the_old_order() -> None:
    g = Groups.explicit(2, dp=[[0, 1]], pp=[[0], [1]])
    r = choose_replacements(["m0", "m1"], g, ["m1"], ["s9", "s1"], {}, EXACT, prefer={"s1"})
    assert (r.chosen, r.method) == (("s1",), "first_free")


@pytest.mark.parametrize(
    ("leaving", "candidates", "message"),
    [(["nope"], ["s1"], "not machines of the job"), (["m0", "m1"], ["s1"], "1 candidates for 2")],
)
def test_bad_requests_are_refused(leaving: list[str], candidates: list[str], message: str) -> None:
    g = Groups.explicit(2, dp=[[0, 1]], pp=[[0], [1]])
    with pytest.raises(ValueError, match=message):
        choose_replacements(["m0", "m1"], g, leaving, candidates, {"s1": P("a")})


def _random_case(seed: int) -> tuple[list[str], Groups, list[str], list[str], dict[str, P]]:
    rnd = random.Random(seed)
    pp, dp = rnd.choice([2, 3, 4]), rnd.choice([2, 3, 4, 6])
    g = Groups.of(JobTopology(job="j", pp=pp, dp=dp, ranks_per_machine=1))
    n, pods = g.n_slots, rnd.choice([2, 3, 4])
    machines = [f"m{i}" for i in range(n)]
    pool = [f"s{i}" for i in range(rnd.randrange(1, 8))]
    pos = {m: P(f"p{rnd.randrange(pods)}", f"r{rnd.randrange(2)}") for m in [*machines, *pool]}
    if rnd.random() < 0.5 and len(pool) >= pp:  # a pipeline over-evicted
        d = rnd.randrange(dp)
        leaving = [machines[d + dp * p] for p in range(pp)]
    else:
        leaving = rnd.sample(machines, rnd.randrange(1, min(len(pool), n) + 1))
    return machines, g, leaving, rnd.sample(pool, len(pool)), pos


def _objective(r: Replacement) -> float:
    return r.after.objective(1.0, 1.0)


def test_the_heuristic_agrees_with_the_exact_search_on_small_cases() -> None:
    agree = 0
    for seed in range(200):
        machines, g, leaving, pool, pos = _random_case(seed)
        exact = choose_replacements(machines, g, leaving, pool, pos, EXACT)
        heuristic = choose_replacements(machines, g, leaving, pool, pos, HEURISTIC)
        assert exact.method == "exact"
        assert exact.key <= heuristic.key  # the exact search is never beaten
        agree += _objective(exact) == _objective(heuristic)
    # Measured: 197 of 200 (a local search: single moves do not always reach the optimum).
    assert agree >= 195


def test_never_worse_than_first_free() -> None:
    for seed in range(200):
        machines, g, leaving, pool, pos = _random_case(seed)
        plain = dict(zip(leaving, first_free(pool, len(leaving)), strict=True))
        baseline = measure([plain.get(m, m) for m in machines], g, pos).objective(1.0, 1.0)
        for cfg in (EXACT, HEURISTIC, PlacementConfig(exact_nodes=5)):
            assert _objective(choose_replacements(machines, g, leaving, pool, pos, cfg)) <= baseline


def test_the_answer_is_deterministic_and_independent_of_pool_order() -> None:
    for seed in range(40):
        machines, g, leaving, pool, pos = _random_case(seed)
        answers = {
            choose_replacements(machines, g, leaving, order, pos, EXACT).chosen
            for order in itertools.islice(itertools.permutations(pool), 6)
        }
        assert len(answers) == 1
        again = choose_replacements(machines, g, leaving, pool, pos, HEURISTIC)
        assert again == choose_replacements(machines, g, leaving, pool, pos, HEURISTIC)


def test_weights_trade_dp_spread_against_pp_spread() -> None:
    # Slot 0 leaves; its DP group's other machine is in pod c, its PP group's in pod a: a
    # standby in c keeps the DP group in one pod, one in a the pipeline.
    g = Groups.explicit(3, dp=[[0, 1]], pp=[[0, 2]])
    machines, pos = _job(["b", "c", "a"])
    pos |= {"sa": P("a"), "sc": P("c")}
    dp_heavy = choose_replacements(machines, g, ["m0"], ["sa", "sc"], pos, PlacementConfig(alpha=2, beta=1))
    pp_heavy = choose_replacements(machines, g, ["m0"], ["sa", "sc"], pos, PlacementConfig(alpha=1, beta=2))
    assert dp_heavy.chosen == ("sc",) and (dp_heavy.after.dp, dp_heavy.after.pp) == (1, 2)
    assert pp_heavy.chosen == ("sa",) and (pp_heavy.after.dp, pp_heavy.after.pp) == (2, 1)


def test_the_pool_covers_every_pod_then_follows_the_jobs_weight() -> None:
    job = [f"m{i}" for i in range(10)]
    pos = {m: P("big" if i < 7 else "small", f"r{i % 2}") for i, m in enumerate(job)}
    free = [f"f{i}" for i in range(8)]
    pos |= {
        f: P("big" if i < 4 else ("small" if i < 6 else "other"), f"r{i % 2}") for i, f in enumerate(free)
    }
    picked = place_standbys(free, 4, job, pos)
    assert [pos[f].pod for f in picked] == ["big", "small", "big", "big"]
    assert {pos[f].rack for f in picked if pos[f].pod == "big"} == {"r0", "r1"}  # both racks used
    assert uncovered_pods(job, picked[:1], pos) == ["small"] and uncovered_pods(job, picked, pos) == []
    assert place_standbys(free, 4, job, pos) == picked  # deterministic
    assert place_standbys(free, 4, job, pos, held=["f0"])[0] in {"f4", "f5"}  # big is covered: small
    assert len(place_standbys(free, 20, job, pos)) == 8  # no more than there are


def test_machines_of_unknown_position_are_far_from_everything() -> None:
    g = Groups.explicit(2, dp=[[0, 1]], pp=[[0], [1]])
    r = choose_replacements(["m0", "m1"], g, ["m1"], ["s1", "s2"], {"m0": P("a"), "s2": P("a")}, EXACT)
    assert r.chosen == ("s2",) and r.after.dp == 1
    assert measure(["m0", "m1"], g, {}).dp == 2
