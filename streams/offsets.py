"""Every input record handled: find a partition's skipped records and read them again.

The agents' Faust consumer can move a partition past records no agent handled when a rebalance
leaves the partition with the same worker.  Records fetched before the rebalance reach the agents
after it as the old generation's: Faust drops them unhandled and acknowledges them (so the next
commit may pass them), and a batch fetched before the rebalance can go on being delivered after
Faust's seek to the committed offsets, so that Faust's "read offset" passes the records the seek
meant to read again and drops them when they come back.  Seen in CI (chaos ``worker_kill``, two
workers, one SIGKILLed): five of 60 Xid lines were detected and never decided, all on detection
partitions the surviving worker had before and after the rebalance (faust-streaming 0.15.3).

:class:`OffsetGuard` keeps, per input partition a worker holds, the next offset its agent
expects.  The records of our input topics have consecutive offsets (no transactions, no
compaction), so a record past that offset means the ones in between were lost here: the agent
skips it and the worker seeks the partition back (:meth:`trainguard.streams.context.WorkerContext.guard`).
A record at or before the expected offset is handled (a redelivery after a rebalance: the stateful
stages skip what their state holds, decisions keep their ids).  A gap that is real (a transaction
marker of another producer's transaction, records deleted by retention while the worker was
away) shows itself: read again from the expected offset, the partition delivers the refused record
again, first -- nothing is there before it.  Once the same record has been refused
``repeats_for_real`` times over at least ``real_after_s``, the gap is accepted and logged (a stale
batch can bring a refused record back once in an unlucky order; not again and again for a
second).  As a backstop, a gap still open ``accept_after_s`` after its first seek back is accepted
too: never sought forever.

A partition newly assigned to the worker starts at the group's committed offset
(:meth:`OffsetGuard.start`, read by the worker before its agents take a record of the new
assignment).  Without it the first record delivered would be taken for the start, and Faust can
deliver a record prefetched out of order first (faust-streaming issue 221), then drop the earlier
ones it reads again as already read: in the chaos suite's ``worker_kill`` the records produced
between the kill and the rebalance, on partitions that moved to the surviving worker, were lost
that way or never delivered at all (2 runs of 13).  A partition that leaves the worker's
assignment is forgotten.

And a partition whose records stopped coming (its high watermark past the expected offset, nothing
delivered for ``stuck_s``) is sought to the expected offset (:meth:`OffsetGuard.stuck`): whatever
left the consumer's position past records no agent saw, they are read.

>>> g = OffsetGuard(clock=lambda: 0.0)
>>> [g.check("t", 0, offset).rewind_to for offset in (10, 11, 14, 12, 13, 14, 15)]
[None, None, 12, None, None, None, None]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

TP = tuple[str, int]


@dataclass(frozen=True)
class Verdict:
    """What to do with one record: handle it (``rewind_to`` None), or skip it and seek its
    partition back to ``rewind_to``.  ``accepted_gap``: (first, last) offsets given up as absent."""

    rewind_to: int | None = None
    accepted_gap: tuple[int, int] | None = None
    #: the first seek back to ``rewind_to`` (later ones: records of the same stale batch).
    new_gap: bool = False


OK = Verdict()


class OffsetGuard:
    """The next offset expected on each input partition (see the module docstring)."""

    def __init__(
        self,
        accept_after_s: float = 30.0,
        repeats_for_real: int = 3,
        real_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.accept_after_s = accept_after_s
        self.repeats_for_real, self.real_after_s = repeats_for_real, real_after_s
        self._clock = clock
        #: partition -> the offset of the next record it should deliver.
        self._next: dict[TP, int] = {}
        #: partition -> when it last delivered a record, or was started or sought.
        self._active: dict[TP, float] = {}
        #: partition -> (offset sought back to, when first, how often each offset was refused since).
        self._rewound: dict[TP, tuple[int, float, dict[int, int]]] = {}

    def check(self, topic: str, partition: int, offset: int) -> Verdict:
        tp = (topic, partition)
        self._active[tp] = self._clock()
        expected = self._next.get(tp)
        if expected is None or offset <= expected:
            self._next[tp] = max(expected or 0, offset + 1)
            if expected is not None and offset == expected:
                self._rewound.pop(tp, None)  # the gap, if there was one, is read again
            return OK
        now = self._clock()
        open_ = self._rewound.get(tp)
        if open_ is not None and open_[0] == expected:
            _, since, refused = open_
            refused[offset] = refused.get(offset, 0) + 1
            real = refused[offset] >= self.repeats_for_real and now - since >= self.real_after_s
            if real or now - since >= self.accept_after_s:
                # Read again from ``expected`` time after time, the partition begins with this
                # record: nothing is there before it (or the backstop: the gap outlived its grace).
                del self._rewound[tp]
                self._next[tp] = offset + 1
                return Verdict(accepted_gap=(expected, offset - 1))
            return Verdict(rewind_to=expected)
        self._rewound[tp] = (expected, now, {offset: 1})
        return Verdict(rewind_to=expected, new_gap=True)

    def accept(self, topic: str, partition: int, offset: int) -> None:
        """Take ``offset`` as handled whatever came before (the seek back failed)."""
        tp = (topic, partition)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)
        self._rewound.pop(tp, None)

    def assigned(self, partitions: Iterable[TP]) -> set[TP]:
        """The worker's new assignment: forget every partition outside it; the partitions new to
        the worker (to :meth:`start` at the group's committed offsets)."""
        keep = set(partitions)
        for tp in [tp for tp in self._next if tp not in keep]:
            del self._next[tp]
            self._rewound.pop(tp, None)
            self._active.pop(tp, None)
        return keep - set(self._next)

    def start(self, topic: str, partition: int, committed: int) -> None:
        """A partition new to the worker: its records are expected from ``committed`` on."""
        tp = (topic, partition)
        if tp not in self._next:
            self._next[tp] = committed
            self._active[tp] = self._clock()

    def stuck(self, highwaters: dict[TP, int], stuck_s: float) -> list[tuple[TP, int]]:
        """The partitions (and where to seek them) with records past the expected offset that
        delivered nothing for ``stuck_s``; each is taken as sought now (asked again only after
        another ``stuck_s``)."""
        now, out = self._clock(), []
        for tp, high in highwaters.items():
            expected = self._next.get(tp)
            if expected is None or high <= expected or now - self._active.get(tp, now) < stuck_s:
                continue
            self._active[tp] = now
            out.append((tp, expected))
        return out

    def expected(self, topic: str, partition: int) -> int | None:
        return self._next.get((topic, partition))
