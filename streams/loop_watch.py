"""Say what blocks a worker's event loop: a thread that notices when the loop stops ticking and
logs where the loop's thread is at that moment.

Every agent, timer and the Kafka heartbeats share one asyncio loop; when one step of it runs for
seconds (a synchronous call, a huge state document, a CPU-starved machine), every decision waits
and Faust only says afterwards that a timer "is overlapping".  The loop bumps a timestamp every
``tick_s``; a daemon thread checks it, and when it is older than ``block_s`` it logs a WARNING
with the loop thread's current stack (``sys._current_frames``) -- once per blocked stretch -- and
how long the stretch lasted once the loop runs again.  ``trainguard_loop_blocked_seconds_total``
counts the time.  The check thread needs the GIL too: a C call that holds it shows up only once
it returns (the log then says how long the stretch was, not where it was).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger(__name__)


class LoopWatch:
    """Watch ``loop`` from a thread of its own (see the module docstring)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        block_s: float = 1.0,
        tick_s: float = 0.1,
        on_blocked: Callable[[float], None] | None = None,
    ) -> None:
        self.loop, self.block_s, self.tick_s = loop, block_s, tick_s
        self.on_blocked = on_blocked
        self.last_tick = time.monotonic()
        self.loop_thread: int | None = None
        #: the stacks logged so far (what a test or /metrics can look at).
        self.reports: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="loop-watch", daemon=True)

    def start(self) -> None:
        self.loop.call_soon_threadsafe(self._tick)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _tick(self) -> None:
        self.loop_thread = threading.get_ident()
        self.last_tick = time.monotonic()
        if not self._stop.is_set():
            self.loop.call_later(self.tick_s, self._tick)

    def _watch(self) -> None:
        blocked_since: float | None = None
        while not self._stop.wait(self.tick_s):
            behind = time.monotonic() - self.last_tick
            if behind > self.block_s and blocked_since is None:
                blocked_since = self.last_tick
                self._report(behind)
            elif behind <= self.block_s and blocked_since is not None:
                stretch = self.last_tick - blocked_since
                log.warning("event loop ran again after %.1f s blocked", stretch)
                if self.on_blocked is not None:
                    self.on_blocked(stretch)
                blocked_since = None

    def _report(self, behind: float) -> None:
        frame = sys._current_frames().get(self.loop_thread) if self.loop_thread is not None else None
        where = "".join(traceback.format_stack(frame)[-12:]) if frame is not None else "(no stack)\n"
        self.reports.append(where)
        log.warning("event loop blocked for %.1f s so far; its thread is at:\n%s", behind, where.rstrip())
