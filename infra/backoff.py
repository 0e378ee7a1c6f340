"""One exponential backoff policy for every retry loop (sink inserts, exporter delivery, recovery
steps, reconnects), so they cannot drift apart in how they wait.

A :class:`Backoff` is a small mutable iterator over delays: ``next_delay()`` returns the wait
before the next attempt and doubles it (capped), ``reset()`` starts over after a success.  Jitter
is optional and seeded per instance: many exporters reconnecting to a broker that came back
should not all knock at the same moment, but a test wants the same delays every run.

>>> b = Backoff(initial_s=1.0, max_s=5.0)
>>> [b.next_delay() for _ in range(5)]
[1.0, 2.0, 4.0, 5.0, 5.0]
>>> b.reset(); b.next_delay()
1.0
>>> b.peek()
2.0
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Exponential backoff: ``initial_s``, times ``factor`` per failure, at most ``max_s``.

    ``jitter`` spreads each delay uniformly over ``[delay * (1 - jitter), delay]``.
    """

    initial_s: float = 1.0
    max_s: float = 30.0
    factor: float = 2.0
    jitter: float = 0.0
    seed: int | None = None
    _next: float = field(init=False, repr=False)
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.initial_s < 0 or self.max_s < 0:
            raise ValueError("backoff delays must be >= 0")
        if self.factor < 1:
            raise ValueError(f"backoff factor must be >= 1, got {self.factor}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"backoff jitter must be within [0, 1], got {self.jitter}")
        self._rng = random.Random(self.seed)
        self.reset()

    def reset(self) -> None:
        """After a success: the next failure waits ``initial_s`` again."""
        self._next = min(self.initial_s, self.max_s)

    def peek(self) -> float:
        """The delay :meth:`next_delay` will return (without jitter), e.g. for a log line."""
        return self._next

    def next_delay(self) -> float:
        """The wait before the next attempt; the one after it grows by ``factor`` (capped)."""
        delay = self._next
        self._next = min(max(delay * self.factor, 0.01), self.max_s)
        if self.jitter:
            delay *= 1 - self.jitter * self._rng.random()
        return delay
