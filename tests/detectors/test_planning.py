"""Planning helpers: standby pool (paper Table 5), dual-phase replay (Fig. 6), backup peers (Fig. 9)."""

from __future__ import annotations

import math

import pytest

from trainguard.detectors.planning import (
    PlanningError,
    backup_peers,
    binomial_cdf,
    locate_faulty_machine,
    locate_from_results,
    machine_backup_peers,
    plan_dual_phase_replay,
    standby_pool_size,
    valid_replay_ks,
)
from trainguard.schemas.topology import DIMS, JobTopology


@pytest.mark.parametrize(("machines", "standbys"), [(128, 2), (256, 2), (512, 3), (1024, 4)])
def test_paper_table5_standby_counts(machines: int, standbys: int) -> None:
    assert standby_pool_size(machines, 1.2e-3) == standbys


def test_binomial_cdf_matches_exact_sum() -> None:
    for n, p in [(10, 0.3), (40, 0.05), (7, 0.9)]:
        for k in range(n + 1):
            exact = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))
            assert binomial_cdf(k, n, p) == pytest.approx(exact, abs=1e-12)
    assert (
        binomial_cdf(3, 10, 0.0) == 1.0
        and binomial_cdf(3, 10, 1.0) == 0.0
        and binomial_cdf(-1, 10, 0.5) == 0.0
    )


def test_standby_edges_and_errors() -> None:
    assert standby_pool_size(0, 0.5) == 0
    assert standby_pool_size(100, 0.0) == 0
    assert standby_pool_size(10, 1.0) == 10
    assert standby_pool_size(1024, 1.2e-3, quantile=0.999) > 4
    for args in [(-1, 0.1), (10, 1.5), (10, -0.1)]:
        with pytest.raises(PlanningError):
            standby_pool_size(*args)
    with pytest.raises(PlanningError):
        standby_pool_size(10, 0.1, quantile=1.0)


def test_figure6_example() -> None:
    plan = plan_dual_phase_replay(pp=2, dp=12, k=2)
    assert (plan.m, plan.n, plan.n_machines) == (4, 6, 24)
    assert len(plan.horizontal) == 6 and all(len(g) == 4 for g in plan.horizontal)
    assert len(plan.vertical) == 6 and all(len(g) == 4 for g in plan.vertical)
    assert locate_faulty_machine(plan, 3, 1) == 13


@pytest.mark.parametrize(("pp", "dp"), [(1, 1), (2, 12), (4, 16), (3, 9), (8, 64), (2, 8)])
def test_every_machine_is_uniquely_located(pp: int, dp: int) -> None:
    for k in valid_replay_ks(pp, dp):
        plan = plan_dual_phase_replay(pp, dp, k)
        # every machine is in exactly one group of each phase
        assert sorted(x for g in plan.horizontal for x in g) == list(range(plan.n_machines))
        assert sorted(x for g in plan.vertical for x in g) == list(range(plan.n_machines))
        for x in range(plan.n_machines):
            h = next(i for i, g in enumerate(plan.horizontal) if x in g)
            v = next(i for i, g in enumerate(plan.vertical) if x in g)
            assert locate_faulty_machine(plan, h, v) == x
            h_ok = [g != h for g in range(len(plan.horizontal))]
            v_ok = {g: g != v for g in range(len(plan.vertical))}
            assert locate_from_results(plan, h_ok, v_ok) == x


def test_replay_plan_errors() -> None:
    with pytest.raises(PlanningError, match="exceeds"):
        plan_dual_phase_replay(pp=4, dp=8, k=2)  # m = 8 > n = 4
    with pytest.raises(PlanningError, match="divide"):
        plan_dual_phase_replay(pp=2, dp=12, k=5)
    with pytest.raises(PlanningError):
        plan_dual_phase_replay(pp=0, dp=4)
    with pytest.raises(PlanningError, match="groups of m"):
        plan_dual_phase_replay(pp=2, dp=12, k=2, n_machines=25)
    plan = plan_dual_phase_replay(pp=2, dp=12, k=2)
    with pytest.raises(PlanningError, match="no horizontal"):
        locate_faulty_machine(plan, 6, 0)
    with pytest.raises(PlanningError, match="exactly one failing"):
        locate_from_results(plan, [False, False, True, True, True, True], [True] * 5 + [False])
    with pytest.raises(PlanningError, match="none"):
        locate_from_results(plan, [True] * 6, [True] * 6)


def _shares(t: JobTopology, a: int, b: int) -> bool:
    return any(b in t.group(d, a) for d in DIMS)


@pytest.mark.parametrize(
    ("tp", "pp", "dp", "rpm"),
    [(2, 4, 2, 2), (8, 4, 8, 8), (2, 2, 2, 4), (1, 4, 4, 1), (4, 1, 4, 4), (8, 8, 16, 8), (2, 3, 5, 2)],
)
def test_backup_peers_share_no_group(tp: int, pp: int, dp: int, rpm: int) -> None:
    t = JobTopology(job="j", tp=tp, pp=pp, dp=dp, ranks_per_machine=rpm)
    peers = backup_peers(t)
    assert sorted(peers) == sorted(peers.values()) == list(range(t.world_size))  # a permutation
    assert not any(_shares(t, r, p) for r, p in peers.items())
    if t.num_machines > 1:
        assert all(t.machine_of(r) != t.machine_of(p) for r, p in peers.items())


def test_figure9_pairs() -> None:
    t = JobTopology(job="fig9", tp=2, pp=4, dp=2, ranks_per_machine=2)
    peers = backup_peers(t)
    assert (peers[8], peers[9], peers[2], peers[3]) == (2, 3, 8, 9)
    machines = machine_backup_peers(t)
    assert machines[4] == 1 and machines[1] == 4


@pytest.mark.parametrize(("tp", "pp", "dp", "rpm"), [(2, 4, 2, 2), (8, 4, 8, 8), (4, 2, 8, 8), (2, 4, 4, 4)])
def test_machine_peers_share_no_group(tp: int, pp: int, dp: int, rpm: int) -> None:
    t = JobTopology(job="j", tp=tp, pp=pp, dp=dp, ranks_per_machine=rpm)
    peers = machine_backup_peers(t)
    assert sorted(peers) == list(range(t.num_machines))
    for m, p in peers.items():
        assert m != p
        assert not any(_shares(t, a, b) for a in t.ranks_of_machine(m) for b in t.ranks_of_machine(p))


def test_impossible_backups_are_clear_errors() -> None:
    with pytest.raises(PlanningError, match="fewer than two parallel dimensions"):
        backup_peers(JobTopology(job="zero", tp=1, pp=1, dp=16, ranks_per_machine=8))
    with pytest.raises(PlanningError, match="no cross-group backup machine"):
        machine_backup_peers(JobTopology(job="dp-only", tp=8, pp=1, dp=4, ranks_per_machine=8))
