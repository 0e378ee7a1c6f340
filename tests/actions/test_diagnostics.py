"""The real stop-time tests: torch alignment step and gloo all-gather between local processes."""

from __future__ import annotations

import pytest

from actions.diagnostics import LocalFaults, alignment_digest, ring_pairs, run_local


def test_alignment_digest_is_bitwise_reproducible_and_sensitive() -> None:
    assert alignment_digest() == alignment_digest()
    assert alignment_digest(perturb=True) != alignment_digest()


def test_ring_pairs() -> None:
    assert ring_pairs(1) == [] and ring_pairs(2) == [(0, 1)]
    assert ring_pairs(3) == [(0, 1), (1, 2), (2, 0)]


@pytest.mark.slow
def test_three_machines_find_the_odd_one_out_in_each_test() -> None:
    machines = ["m0", "m1", "m2"]
    faults = LocalFaults(perturb=frozenset({"m1"}), corrupt=frozenset({"m2"}))
    results = run_local(machines, ["alignment", "connectivity"], faults, timeout_s=20)
    failed = {(r.test, r.machine) for r in results if not r.passed}
    assert failed == {("alignment", "m1"), ("connectivity", "m2")}
    assert len(results) == 6


@pytest.mark.slow
def test_unreachable_machine_fails_connectivity_and_two_machines_cannot_outvote() -> None:
    three = run_local(["a", "b", "c"], ["connectivity"], LocalFaults(absent=frozenset({"c"})), timeout_s=4)
    assert {r.machine for r in three if not r.passed} == {"c"}
    two = run_local(["a", "b"], ["alignment"], LocalFaults(perturb=frozenset({"b"})))
    assert all(not r.passed and "no majority" in r.detail for r in two)
