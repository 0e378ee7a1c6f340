"""Count/window threshold logic: "evict only after 2 alerts within 5 minutes".

Detectors never read the wall clock: every observation carries the caller's timestamp, so a
replay of an old log gives the same answers as the live stream.  Timestamps may arrive slightly
out of order (several log sources merged); events are kept sorted.

``dedup_s`` collapses bursts: one fault often prints several lines within a second (an Xid 13 per
SM, an OOM line per rank), and those should count as one occurrence, not as "repeated".
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable


class WindowCounter:
    """Occurrences of one event inside a sliding time window.

    Parameters
    ----------
    window_s
        Length of the window in seconds; an event at ``t`` counts for observations in
        ``[t, t + window_s]``.
    dedup_s
        Events closer than this to an already counted event are not counted again.
    max_events
        Memory bound: the oldest events are dropped beyond it.

    Examples
    --------
    >>> w = WindowCounter(window_s=300)
    >>> w.observe(0.0), w.observe(100.0), w.observe(350.0), w.observe(1000.0)
    (1, 2, 2, 1)
    >>> d = WindowCounter(window_s=300, dedup_s=5)
    >>> d.observe(10.0), d.observe(10.5), d.observe(20.0)
    (1, 1, 2)
    """

    def __init__(self, window_s: float, dedup_s: float = 0.0, max_events: int = 10_000) -> None:
        if not window_s > 0 or not math.isfinite(window_s):
            raise ValueError(f"window_s must be a positive finite number, got {window_s!r}")
        if dedup_s < 0:
            raise ValueError(f"dedup_s must be >= 0, got {dedup_s!r}")
        self.window_s = float(window_s)
        self.dedup_s = float(dedup_s)
        self.max_events = max_events
        self._events: list[float] = []

    def observe(self, ts: float) -> int:
        """Record an event at ``ts``; return how many events fall in ``[ts - window_s, ts]``."""
        if not math.isfinite(ts):
            raise ValueError(f"timestamp must be finite, got {ts!r}")
        ev = self._events
        i = bisect.bisect_left(ev, ts)
        near = (i < len(ev) and ev[i] - ts <= self.dedup_s) or (i > 0 and ts - ev[i - 1] <= self.dedup_s)
        if not (self.dedup_s > 0 and near):
            ev.insert(i, ts)
        # Forget what can no longer fall inside any window ending at the newest event.
        horizon = ev[-1] - self.window_s
        drop = bisect.bisect_left(ev, horizon)
        if drop or len(ev) > self.max_events:
            del ev[: max(drop, len(ev) - self.max_events)]
        return self.count(ts)

    def count(self, ts: float) -> int:
        """Events in ``[ts - window_s, ts]`` without recording anything."""
        ev = self._events
        return bisect.bisect_right(ev, ts) - bisect.bisect_left(ev, ts - self.window_s)


class WindowTracker:
    """A :class:`WindowCounter` per key, created on first use, least recently used dropped.

    >>> t = WindowTracker()
    >>> t.observe(("nic-link-down", "ib0"), 0.0, window_s=300), t.observe(("nic-link-down", "ib1"), 10.0, 300)
    (1, 1)
    >>> t.observe(("nic-link-down", "ib0"), 200.0, window_s=300)
    2
    """

    def __init__(self, max_keys: int = 50_000) -> None:
        self.max_keys = max_keys
        self._counters: OrderedDict[Hashable, WindowCounter] = OrderedDict()

    def observe(self, key: Hashable, ts: float, window_s: float, dedup_s: float = 0.0) -> int:
        """Record an event for ``key`` at ``ts``; return the count in its window."""
        counter = self._counters.get(key)
        if counter is None or counter.window_s != window_s or counter.dedup_s != dedup_s:
            counter = WindowCounter(window_s, dedup_s)
            self._counters[key] = counter
        self._counters.move_to_end(key)
        while len(self._counters) > self.max_keys:
            self._counters.popitem(last=False)
        return counter.observe(ts)

    def __len__(self) -> int:
        return len(self._counters)

    def items(self) -> list[tuple[Hashable, WindowCounter]]:
        return list(self._counters.items())

    def put(self, key: Hashable, counter: WindowCounter) -> None:
        """Set ``key``'s counter (a restored one)."""
        self._counters[key] = counter
        self._counters.move_to_end(key)
        while len(self._counters) > self.max_keys:
            self._counters.popitem(last=False)

    def remove(self, key: Hashable) -> None:
        self._counters.pop(key, None)


class StreamClock:
    """The "now" a time-based check may assume on a stream that can lag behind the wall clock.

    A stall check compares "now" with the last step it has *processed*.  With the wall clock,
    a worker that falls 6 s behind its input (a CPU spike, a rebalance) sees every job as stalled
    for 6 s.  With event time alone, a job whose ranks all stopped would never look stalled, since
    nothing arrives to move the clock.  The usual answer (a watermark with idle sources): while
    events keep arriving, now is the newest event time seen (the stream says how far it got);
    once nothing has arrived for ``idle_s`` the input is drained, and now is the wall clock.
    Between arrivals the event clock runs on at wall speed from the newest event.

    >>> c = StreamClock(idle_s=1.0)
    >>> c.now(10_000)                      # nothing seen yet: the wall clock
    10000
    >>> c.observe(event_ms=4_000, arrived_ms=10_000)  # a backlog 6 s old is being read
    >>> c.now(10_200)                      # 0.2 s later: the stream's time, 0.2 s on
    4200
    >>> c.now(11_500)                      # nothing new for 1.5 s: caught up, wall clock again
    11500

    Nothing arriving is not the same as nothing to read: a worker whose event loop is blocked
    for seconds (an overloaded host) reads nothing while its input waits.  ``backlog``, when
    given, says whether records are waiting unread (the consumer's high watermark is past what
    was processed); while they are, now is the newest event read, whatever the idle time.

    >>> c.backlog = lambda: True
    >>> c.now(11_500)                      # 1.5 s without a read, but records are waiting
    4000

    A backlog that reads nothing for ``backlog_idle_s`` is not believed: a high watermark that
    never meets the offsets read (a gap the consumer skips) must not hide a real stall for good.

    >>> c.now(20_001)
    20001
    """

    def __init__(
        self, idle_s: float = 1.0, backlog: Callable[[], bool] | None = None, backlog_idle_s: float = 10.0
    ) -> None:
        self.idle_ms = int(idle_s * 1000)
        self.backlog_idle_ms = int(backlog_idle_s * 1000)
        self.newest_event_ms: int | None = None
        self.last_arrival_ms: int | None = None
        self.backlog = backlog

    def observe(self, event_ms: int, arrived_ms: int) -> None:
        if self.newest_event_ms is None or event_ms > self.newest_event_ms:
            self.newest_event_ms = event_ms
        self.last_arrival_ms = arrived_ms

    def now(self, wall_ms: int) -> int:
        if self.newest_event_ms is None or self.last_arrival_ms is None:
            return wall_ms
        idle = wall_ms - self.last_arrival_ms
        if idle <= self.backlog_idle_ms and self.backlog is not None and self.backlog():
            return min(wall_ms, self.newest_event_ms)
        if idle > self.idle_ms:
            return wall_ms
        # Never ahead of the wall clock (a producer with a fast clock must not age the others).
        return min(wall_ms, self.newest_event_ms + (wall_ms - self.last_arrival_ms))
