"""The event-loop watch names the code that blocks a worker's loop, and for how long."""

from __future__ import annotations

import asyncio
import time

from trainguard.streams.loop_watch import LoopWatch


def a_synchronous_call_that_takes_long(seconds: float) -> None:
    time.sleep(seconds)


async def _run(block: float) -> tuple[LoopWatch, list[float]]:
    stretches: list[float] = []
    watch = LoopWatch(asyncio.get_running_loop(), block_s=0.2, tick_s=0.02, on_blocked=stretches.append)
    watch.start()
    await asyncio.sleep(0.1)
    a_synchronous_call_that_takes_long(block)
    await asyncio.sleep(0.3)  # the loop runs again: the stretch is measured
    watch.stop()
    return watch, stretches


def test_a_blocked_loop_is_reported_with_the_blocking_call_and_its_length() -> None:
    watch, stretches = asyncio.run(_run(0.8))
    assert len(watch.reports) == 1  # once per blocked stretch, not once per check
    assert "a_synchronous_call_that_takes_long" in watch.reports[0]
    assert len(stretches) == 1 and 0.6 <= stretches[0] <= 1.5


def test_a_loop_that_keeps_running_is_not_reported() -> None:
    watch, stretches = asyncio.run(_run(0.05))
    assert watch.reports == [] and stretches == []
