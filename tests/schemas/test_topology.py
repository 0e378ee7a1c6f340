"""Job topology: Megatron rank order, parallel groups, machines."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainguard.schemas.topology import JobTopology


def test_megatron_default_order_formula() -> None:
    t = JobTopology(job="j", tp=4, pp=3, dp=2, ranks_per_machine=8)
    for tp, dp, pp in itertools.product(range(4), range(2), range(3)):
        assert t.rank(tp=tp, dp=dp, pp=pp) == tp + 4 * dp + 4 * 2 * pp


@given(
    tp=st.integers(1, 4),
    pp=st.integers(1, 4),
    dp=st.integers(1, 4),
    rpm=st.integers(1, 8),
    order=st.sampled_from(["tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "pp-dp-tp"]),
)
def test_groups_partition_the_world_and_coords_invert(
    tp: int, pp: int, dp: int, rpm: int, order: str
) -> None:
    t = JobTopology(job="j", tp=tp, pp=pp, dp=dp, ranks_per_machine=rpm, order=order)
    for r in range(t.world_size):
        assert t.rank(**t.coords(r)._asdict()) == r
    for kind, size in (("tp", tp), ("pp", pp), ("dp", dp)):
        groups = t.groups(kind)  # type: ignore[arg-type]
        assert sorted(itertools.chain.from_iterable(groups)) == list(range(t.world_size))
        assert all(len(g) == size for g in groups)
    # A rank's TP, DP and PP groups share only that rank.
    for r in range(t.world_size):
        g = [set(t.group(k, r)) for k in ("tp", "dp", "pp")]  # type: ignore[arg-type]
        assert g[0] & g[1] == g[0] & g[2] == g[1] & g[2] == {r}


def test_machines() -> None:
    t = JobTopology(job="j", tp=2, pp=2, dp=3, ranks_per_machine=4, machines=["a", "b", "c"])
    assert t.num_machines == 3
    assert t.ranks_of_machine(2) == [8, 9, 10, 11]
    assert t.machines_of(t.group("pp", 1)) == [0, 1]
    assert t.machine_name(1) == "b" and t.machine_index("c") == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"order": "tp-pp"}, "permutation of tp, dp, pp"),
        ({"machines": ["only-one"]}, "machines lists 1 names but the job spans 2 machines"),
    ],
)
def test_invalid_topologies(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        JobTopology(job="j", tp=2, pp=2, dp=2, ranks_per_machine=4, **kwargs)  # type: ignore[arg-type]


def test_rank_out_of_range() -> None:
    with pytest.raises(ValueError, match="outside"):
        JobTopology(job="j", tp=2).coords(2)
