"""Waiting on a condition, never on the clock: the one polling helper of the test suite.

A test that needs something to have happened (a process up, a row in ClickHouse, an event on a
topic, a file written) polls for exactly that up to a deadline and fails naming what it awaited.
A bare ``sleep`` that hopes things are done by then is flaky on a loaded two-core CI host and
needlessly slow everywhere else.  (A sleep that deliberately lets time pass -- to age a window,
to keep a broker down, to pace a fake job -- is not synchronisation and stays a sleep.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T | None],
    timeout_s: float,
    what: str | Callable[[], str],
    *,
    interval_s: float = 0.1,
) -> T:
    """Call ``condition`` until it returns something truthy and return that value (so a condition
    returning ``X | None`` gives an ``X``).

    After ``timeout_s`` seconds raise ``AssertionError("timed out after N s waiting for <what>")``;
    ``what`` may be a callable, evaluated only then (to append a log tail or the state last seen).
    The condition is always evaluated at least once, and once more at the deadline.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        time.sleep(min(interval_s, remaining))
    description = what() if callable(what) else what
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {description}")
