"""OffsetGuard: a partition's skipped records are sought back to, a real gap is accepted in time,
and a partition that left the worker is forgotten."""

from __future__ import annotations

from trainguard.streams.offsets import OffsetGuard


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_consecutive_records_and_redeliveries_are_handled() -> None:
    g = OffsetGuard(clock=Clock())
    assert [g.check("t", 0, o).rewind_to for o in (5, 6, 7, 3, 4, 5, 8)] == [None] * 7
    assert g.expected("t", 0) == 9


def test_a_record_after_skipped_ones_is_refused_until_they_are_read_again() -> None:
    g = OffsetGuard(clock=Clock())
    g.check("t", 0, 10)
    first = g.check("t", 0, 15)  # 11-14 never delivered
    assert (first.rewind_to, first.new_gap) == (11, True)
    again = g.check("t", 0, 16)  # the rest of a stale batch: sought back again, logged once
    assert (again.rewind_to, again.new_gap) == (11, False)
    assert all(g.check("t", 0, o).rewind_to is None for o in range(11, 17))
    assert g.check("t", 0, 17).rewind_to is None


def test_partitions_and_topics_are_apart() -> None:
    g = OffsetGuard(clock=Clock())
    g.check("t", 0, 10)
    g.check("t", 1, 100)
    g.check("u", 0, 7)
    assert g.check("t", 1, 101).rewind_to is None
    assert g.check("u", 0, 8).rewind_to is None
    assert g.check("t", 0, 12).rewind_to == 11


def test_a_record_refused_again_and_again_for_a_second_is_a_real_gap() -> None:
    clock = Clock()
    g = OffsetGuard(clock=clock)
    g.check("t", 0, 10)
    assert g.check("t", 0, 12).rewind_to == 11  # 11: a transaction marker, never delivered
    assert g.check("t", 0, 12).rewind_to == 11  # read again from 11: 12 comes first, twice
    assert g.check("t", 0, 12).rewind_to == 11  # three times, but within the second: not yet
    clock.now = 1.0
    v = g.check("t", 0, 12)
    assert v.rewind_to is None and v.accepted_gap == (11, 11)
    assert g.check("t", 0, 13).rewind_to is None


def test_a_record_back_once_in_an_unlucky_order_is_not_taken_for_a_real_gap() -> None:
    clock = Clock()
    g = OffsetGuard(clock=clock)
    g.check("t", 0, 10)
    clock.now = 5.0
    assert [g.check("t", 0, o).rewind_to for o in (18, 19, 18)] == [11, 11, 11]
    assert g.check("t", 0, 11).rewind_to is None


def test_a_stale_batch_is_refused_record_by_record_then_read_in_order() -> None:
    g = OffsetGuard(clock=Clock())
    g.check("t", 0, 10)
    assert [g.check("t", 0, o).rewind_to for o in (15, 16, 17)] == [11, 11, 11]
    assert [g.check("t", 0, o).accepted_gap for o in range(11, 18)] == [None] * 7
    assert g.expected("t", 0) == 18


def test_a_gap_still_open_after_the_grace_is_accepted() -> None:
    clock = Clock()
    g = OffsetGuard(accept_after_s=30.0, clock=clock)
    g.check("t", 0, 10)
    assert g.check("t", 0, 20).rewind_to == 11
    clock.now = 29.9
    assert g.check("t", 0, 21).rewind_to == 11
    clock.now = 30.0
    v = g.check("t", 0, 22)
    assert v.rewind_to is None and v.accepted_gap == (11, 21)
    assert g.check("t", 0, 23).rewind_to is None


def test_a_new_gap_restarts_the_grace() -> None:
    clock = Clock()
    g = OffsetGuard(accept_after_s=30.0, clock=clock)
    g.check("t", 0, 10)
    g.check("t", 0, 13)
    clock.now = 20.0
    for o in (11, 12, 13):
        g.check("t", 0, o)
    clock.now = 40.0
    assert g.check("t", 0, 20).new_gap  # another gap, not the old one's grace
    clock.now = 60.0
    assert g.check("t", 0, 21).rewind_to == 14


def test_a_partition_that_left_the_worker_starts_where_it_is_delivered() -> None:
    g = OffsetGuard(clock=Clock())
    g.check("t", 0, 10)
    g.check("t", 1, 10)
    g.assigned([("t", 1)])
    assert g.expected("t", 0) is None
    assert g.check("t", 0, 50).rewind_to is None  # another worker read 11-49 meanwhile
    assert g.check("t", 1, 12).rewind_to == 11  # kept across the rebalance: still checked


def test_accept_takes_a_record_whatever_came_before() -> None:
    g = OffsetGuard(clock=Clock())
    g.check("t", 0, 10)
    assert g.check("t", 0, 14).rewind_to == 11
    g.accept("t", 0, 14)
    assert g.check("t", 0, 15).rewind_to is None


def test_a_new_partition_starts_at_the_committed_offset() -> None:
    g = OffsetGuard(clock=Clock())
    assert g.assigned([("t", 0), ("t", 1)]) == {("t", 0), ("t", 1)}
    g.start("t", 0, 40)
    # A record prefetched out of order comes first: the ones before it are read first.
    assert g.check("t", 0, 45).rewind_to == 40
    assert [g.check("t", 0, o).rewind_to for o in range(40, 46)] == [None] * 6
    g.check("t", 1, 7)
    assert g.assigned([("t", 0), ("t", 1), ("t", 2)]) == {("t", 2)}  # only the new one
    g.start("t", 0, 3)  # known already: kept
    assert g.expected("t", 0) == 46


def test_a_partition_that_stopped_delivering_is_sought_to_where_it_stopped() -> None:
    clock = Clock()
    g = OffsetGuard(clock=clock)
    g.start("t", 0, 0)  # new, records 0-2 there, nothing delivered
    g.check("t", 1, 9)  # delivering, nothing more there
    g.check("t", 2, 4)  # delivering, more there
    highs = {("t", 0): 3, ("t", 1): 10, ("t", 2): 9, ("t", 3): 5}  # t3: never started here
    clock.now = 19.0
    assert g.stuck(highs, 20.0) == []
    clock.now = 20.0
    assert g.stuck(highs, 20.0) == [(("t", 0), 0), (("t", 2), 5)]
    clock.now = 30.0
    assert g.stuck(highs, 20.0) == []  # sought: asked again only after another 20 s
    g.check("t", 0, 0)
    clock.now = 49.0
    assert g.stuck(highs, 20.0) == [(("t", 2), 5)]  # t0 delivered at 30 s: not yet
