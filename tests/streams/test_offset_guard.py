"""OffsetGuard: a record after skipped ones names the gap to read first, a new partition starts at
the committed offset, a partition that stopped delivering is listed, and a partition that left the
worker is forgotten."""

from __future__ import annotations

from trainguard.streams.offsets import OffsetGuard


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_consecutive_records_and_redeliveries_are_handled() -> None:
    g = OffsetGuard(clock=Clock())
    assert [g.check("t", 0, o) for o in (5, 6, 7, 3, 4, 5, 8)] == [None] * 7
    assert g.expected("t", 0) == 9


def test_a_record_after_skipped_ones_names_the_gap_until_it_is_filled() -> None:
    g = OffsetGuard(clock=Clock())
    g.check("t", 0, 10)
    assert g.check("t", 0, 15) == 11  # 11-14 never delivered: read them first
    g.filled("t", 0, 15)
    assert g.check("t", 0, 15) is None
    assert g.check("t", 0, 16) is None
    assert [g.check("t", 0, o) for o in range(11, 17)] == [None] * 6  # redelivered later: handled


def test_partitions_and_topics_are_apart() -> None:
    g = OffsetGuard(clock=Clock())
    g.check("t", 0, 10)
    g.check("t", 1, 100)
    g.check("u", 0, 7)
    assert g.check("t", 1, 101) is None
    assert g.check("u", 0, 8) is None
    assert g.check("t", 0, 12) == 11


def test_a_new_partition_starts_at_the_committed_offset() -> None:
    g = OffsetGuard(clock=Clock())
    assert g.assigned([("t", 0), ("t", 1)]) == {("t", 0), ("t", 1)}
    g.start("t", 0, 40)
    # A record prefetched out of order comes first: 40-44 are read before it.
    assert g.check("t", 0, 45) == 40
    g.filled("t", 0, 45)
    assert g.check("t", 0, 45) is None
    g.check("t", 1, 7)
    assert g.assigned([("t", 0), ("t", 1), ("t", 2)]) == {("t", 2)}  # only the new one
    g.start("t", 0, 3)  # known already: kept
    assert g.expected("t", 0) == 46


def test_a_partition_that_left_the_worker_is_forgotten_and_not_tracked() -> None:
    g = OffsetGuard(clock=Clock())
    g.assigned([("t", 0), ("t", 1)])
    g.check("t", 0, 10)
    g.check("t", 1, 10)
    assert g.assigned([("t", 1)]) == set()
    assert g.expected("t", 0) is None
    assert g.check("t", 0, 50) is None  # a stale record of a partition no longer held
    assert g.expected("t", 0) is None  # ... not tracked: if it comes back it starts anew
    assert g.assigned([("t", 0), ("t", 1)]) == {("t", 0)}
    assert g.check("t", 1, 12) == 11  # kept across the rebalance: still checked


def test_a_partition_that_stopped_delivering_is_listed_with_where_it_stopped() -> None:
    clock = Clock()
    g = OffsetGuard(clock=clock)
    g.start("t", 0, 0)  # new, records 0-2 there, nothing delivered
    g.check("t", 1, 9)  # delivering, nothing more there
    g.check("t", 2, 4)  # delivering, more there
    highs = {("t", 0): 3, ("t", 1): 10, ("t", 2): 9, ("t", 3): 5}  # t3: never started here
    assert g.stuck(highs, 20.0) == []  # behind from now on
    clock.now = 19.0
    assert g.stuck(highs, 20.0) == []
    clock.now = 20.0
    assert g.stuck(highs, 20.0) == [(("t", 0), 0), (("t", 2), 5)]
    clock.now = 30.0
    assert g.stuck(highs, 20.0) == []  # looked at: listed again only after another 20 s
    g.check("t", 0, 0)
    clock.now = 49.0
    assert g.stuck(highs, 20.0) == [(("t", 2), 5)]  # t0 delivered at 30 s: not yet
    g.filled("t", 2, 9)  # nothing but transaction markers there
    clock.now = 80.0
    assert g.stuck(highs, 20.0) == [(("t", 0), 1)]


def test_an_idle_partition_whose_new_record_is_not_yet_delivered_is_not_stuck() -> None:
    clock = Clock()
    g = OffsetGuard(clock=clock)
    g.check("t", 0, 9)  # delivered at 0 s, then idle
    clock.now = 300.0
    assert g.stuck({("t", 0): 11}, 20.0) == []  # a new record just arrived: behind since now
    clock.now = 319.0
    assert g.stuck({("t", 0): 11}, 20.0) == []
    clock.now = 320.0
    assert g.stuck({("t", 0): 11}, 20.0) == [(("t", 0), 10)]  # 20 s behind, nothing delivered


def test_a_fill_that_ends_after_its_partition_left_leaves_nothing_behind() -> None:
    """A fill can outlast a rebalance that takes its partition away: its end must not record an
    expected offset, or the partition, were it to come back, would not start at the group's
    committed offset (and the other worker's records would be read again as a gap)."""
    g = OffsetGuard()
    g.assigned([("t", 0), ("t", 1)])
    g.start("t", 0, 5)
    assert g.check("t", 0, 9) == 5  # a gap: the fill begins
    assert g.assigned([("t", 1)]) == {("t", 1)}  # partition 0 moves away meanwhile
    g.filled("t", 0, 10)  # the fill ends
    assert g.expected("t", 0) is None
    assert g.assigned([("t", 0), ("t", 1)]) == {("t", 0), ("t", 1)}  # back: new, started again
