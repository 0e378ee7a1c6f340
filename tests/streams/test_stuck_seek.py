"""The stuck-partition check seeks only a partition Faust has read past (``streams/app.py``).

A partition Faust has not read that far is lagging, not skipped: in demo run 20261128-141341 a
worker whose fetch loop waited on a slow agent's full queue sought 21 telemetry partitions 114
times, 20-30 s apart, and each seek started the partition's fetch over.
"""

from __future__ import annotations

from collections import defaultdict

from faust.transport.consumer import Consumer
from faust.types import TP

from trainguard.streams.app import faust_went_past


class ReadOffsets:
    """What the check reads of Faust's consumer: its read offsets (a defaultdict, as Faust's)."""

    def __init__(self) -> None:
        self._read_offset: defaultdict[TP, int | None] = defaultdict(lambda: None)


def test_only_a_partition_faust_delivered_past_the_expected_offset_counts_as_skipped() -> None:
    consumer, tp = ReadOffsets(), TP("trainguard.telemetry.host", 1)
    assert not faust_went_past(consumer, tp, 117)  # never read
    consumer._read_offset[tp] = 117  # sought there (a rebalance's committed offset, or our seek)
    assert not faust_went_past(consumer, tp, 117)
    consumer._read_offset[tp] = 116  # delivered up to the record before: lagging
    assert not faust_went_past(consumer, tp, 117)
    consumer._read_offset[tp] = 120  # delivered 120 while the agent never got 117
    assert faust_went_past(consumer, tp, 117)
    assert TP("trainguard.telemetry.host", 2) not in consumer._read_offset  # looking adds nothing


def test_faust_still_keeps_its_read_offsets_where_the_check_reads_them() -> None:
    """The check reads a private attribute of Faust's consumer: an upgrade that drops it must
    fail here, not turn the check into one that seeks every quiet partition."""
    assert "_read_offset" in Consumer.__annotations__
    assert faust_went_past(object(), TP("t", 0), 1)  # unknown: the check goes on as before
