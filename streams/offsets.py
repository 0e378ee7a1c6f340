"""Every input record handled: find the records the consumer skipped, and read them directly.

The agents' Faust consumer can move a partition past records no agent handled around a
rebalance: records fetched before it are dropped as the old generation's (and acknowledged, so a
commit may pass them), and a record prefetched out of order can be delivered first, after which
Faust drops the earlier ones it reads again as already read (faust-streaming issue 221).  Seen in
CI (chaos ``worker_kill``, two workers, one SIGKILLed): five of 60 Xid lines on one detections
partition were detected and never decided; and locally three log lines on a partition that moved
to the surviving worker were never even detected -- both times records produced between the kill
and the rebalance (faust-streaming 0.15.3).

:class:`OffsetGuard` keeps, per input partition the worker holds, the next offset its agent
expects: a partition new to the worker starts at the group's committed offset (:meth:`start`,
read before its agents take a record of the new assignment), a held one goes on after the last
record handled.  A record past the expected offset means the records in between were skipped:
:meth:`check` says so, and the worker reads them directly with a client of its own and hands them
to the agent first, in order (:meth:`trainguard.streams.context.WorkerContext.guard`).  Faust's
own position is never moved for this -- a seek would race Faust's fetch loop, which delivers what
it fetched before the seek and then drops the re-read records as already read.  A gap that holds
no records (another producer's transaction marker) simply reads as empty.  A record at or before
the expected offset is handled: a redelivery after a rebalance (the stateful stages skip what
their state holds, decisions keep their ids).

A partition whose records stopped coming -- the broker's end past its expected offset and nothing
delivered for ``stuck_s`` -- is listed by :meth:`stuck`: the worker reads whether records are
really there and, if so, seeks the partition there (through Faust's consumer thread).

A partition that leaves the worker's assignment is forgotten, and records of partitions the worker
does not hold are not tracked.

>>> g = OffsetGuard()
>>> [g.check("t", 0, offset) for offset in (10, 11, 14)]
[None, None, 12]
>>> g.filled("t", 0, 14)  # 12 and 13 read directly and handled
>>> [g.check("t", 0, offset) for offset in (14, 15, 13)]
[None, None, None]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

TP = tuple[str, int]


class OffsetGuard:
    """The next offset expected on each input partition (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: partition -> the offset of the next record it should deliver.
        self._next: dict[TP, int] = {}
        #: partition -> when it last delivered a record, or was started, filled or sought.
        self._active: dict[TP, float] = {}
        #: partition -> when the broker's end was first seen past its expected offset (this time).
        self._behind: dict[TP, float] = {}
        #: the worker's input partitions (None until the first assignment: every one is taken).
        self._held: set[TP] | None = None

    def check(self, topic: str, partition: int, offset: int) -> int | None:
        """None: handle the record.  Otherwise the first offset of a gap before it: read the
        records from there up to ``offset`` first, then call :meth:`filled`."""
        tp = (topic, partition)
        if self._held is not None and tp not in self._held:
            return None  # not the worker's (a record left in a buffer by a rebalance): not tracked
        self._active[tp] = self._clock()
        expected = self._next.get(tp)
        if expected is None or offset <= expected:
            self._next[tp] = max(expected or 0, offset + 1)
            return None
        return expected

    def filled(self, topic: str, partition: int, offset: int) -> None:
        """The records before ``offset`` were read (or given up): ``offset`` is expected next.
        Nothing for a partition the worker no longer holds (a fill that ended after a rebalance
        took it away must not leave an expected offset behind: were the partition to come back,
        it would not start at the group's committed offset)."""
        tp = (topic, partition)
        if self._held is not None and tp not in self._held:
            return
        self._next[tp] = max(self._next.get(tp, 0), offset)
        self._active[tp] = self._clock()

    def assigned(self, partitions: Iterable[TP]) -> set[TP]:
        """The worker's new assignment: forget every partition outside it; the partitions new to
        the worker (to :meth:`start` at the group's committed offsets)."""
        self._held = set(partitions)
        for tp in [tp for tp in self._next if tp not in self._held]:
            del self._next[tp]
            self._active.pop(tp, None)
            self._behind.pop(tp, None)
        return self._held - set(self._next)

    def start(self, topic: str, partition: int, committed: int) -> None:
        """A partition new to the worker: its records are expected from ``committed`` on."""
        tp = (topic, partition)
        if tp not in self._next:
            self._next[tp] = committed
            self._active[tp] = self._clock()

    def stuck(self, highwaters: dict[TP, int], stuck_s: float) -> list[tuple[TP, int]]:
        """The partitions (and their expected offsets) with records past the expected offset that
        delivered nothing for ``stuck_s``; each is taken as looked at now (listed again only after
        another ``stuck_s``)."""
        now, out = self._clock(), []
        for tp, high in highwaters.items():
            expected = self._next.get(tp)
            if expected is None or high <= expected:
                self._behind.pop(tp, None)
                continue
            # Behind since first seen so: a partition idle for long whose new record has not been
            # delivered yet is not stuck (seen in the demo: seeks a second after a capture's dumps).
            since = max(self._active.get(tp, now), self._behind.setdefault(tp, now))
            if now - since < stuck_s:
                continue
            self._active[tp] = now
            out.append((tp, expected))
        return out

    def expected(self, topic: str, partition: int) -> int | None:
        return self._next.get((topic, partition))
