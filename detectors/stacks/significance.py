"""How likely a fail-slow vote is to come from chance (the false-eviction bound).

A capture of a healthy job still finds a "root" in some rounds: whichever rank happened to be
computing, in its dataloader or writing a checkpoint when py-spy sampled it.  If those roots
are spread at random over the job, one rank still comes out on top of the vote, and with few
rounds it often does so more than once (a healthy 8-rank capture recorded here shows the same
two ranks as roots in 2 of 5 rounds -- exactly what a real straggler looks like).

The test asks: if every round's roots were ranks drawn at random, how likely is it that *some*
rank is a root in at least as many rounds as the top suspect is?  Round ``i`` with a confident
root set ``R_i`` makes a given rank a root with probability ``|R_i| / world`` (0 for a round
without a clear root), so one rank's count is Poisson-binomial; a union bound over the ranks
that could have come out on top turns it into a p-value for the vote:

* with no prior, any of the ``world`` ranks could have: ``p = min(1, world * tail)``;
* when the signal that asked for the capture named ranks (a straggler detection) and the top
  suspect is one of them, only those were tested: ``p = min(1, len(hint) * tail)``.  That is
  the "agreement with the straggler signal": the same data are strong evidence for a rank the
  step times already pointed at and weak evidence for an arbitrary one.

Pure arithmetic, exact (a dynamic programme over the rounds, no scipy).
"""

from __future__ import annotations

from collections.abc import Sequence


def tail_at_least(k: int, probs: Sequence[float]) -> float:
    """P[X >= k] for X the number of successes of independent trials with these probabilities.

    >>> round(tail_at_least(2, [0.125] * 5), 4)
    0.1207
    >>> tail_at_least(0, [0.5]), tail_at_least(3, [0.5, 0.5])
    (1.0, 0.0)
    """
    if k <= 0:
        return 1.0
    if k > len(probs):
        return 0.0
    dist = [1.0] + [0.0] * len(probs)  # dist[j] = P[j successes so far]
    for n, p in enumerate(probs, start=1):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"probability {p} outside [0, 1]")
        for j in range(n, 0, -1):
            dist[j] = dist[j] * (1.0 - p) + dist[j - 1] * p
        dist[0] *= 1.0 - p
    return min(1.0, max(0.0, sum(dist[k:])))


def chance_p_value(hits: int, root_shares: Sequence[float], candidates: int) -> float:
    """Bound on the probability that one of ``candidates`` ranks is a root in ``hits`` or more
    rounds by chance, round ``i`` making a given rank a root with probability ``root_shares[i]``."""
    if candidates < 1:
        raise ValueError("candidates must be >= 1")
    return min(1.0, candidates * tail_at_least(hits, root_shares))
