"""Which parallel group to evict for a set of suspect ranks (ByteRobust §5 over-eviction).

Shared by the analyses that name suspects (py-spy stacks, Flight Recorder dumps): the first kind
in the preference order with one group holding every suspect wins; when no kind does, the group
holding the most suspects (ties: the earlier kind, then the lower ranks).

>>> from trainguard.schemas.topology import JobTopology
>>> t = JobTopology(job="j", tp=2, pp=2, dp=2, ranks_per_machine=2)
>>> choose_group(t, [5], ["pp", "tp", "dp"])
('pp', (1, 5))
>>> choose_group(t, [4, 5], ["pp", "tp", "dp"])
('tp', (4, 5))
"""

from __future__ import annotations

from collections.abc import Sequence

from trainguard.schemas.topology import DIMS, Dim, JobTopology


def check_preference(names: Sequence[str]) -> None:
    """ValueError unless ``names`` lists distinct group kinds (a config's ``evict_preference``)."""
    if not names or len(set(names)) != len(names):
        raise ValueError("evict_preference must list distinct kinds")
    bad = [k for k in names if k not in DIMS]
    if bad:
        raise ValueError(f"evict_preference: unknown kind(s) {bad}; use tp, dp, pp")


def preference_order(names: Sequence[str]) -> list[Dim]:
    """The configured kinds as :data:`Dim` values, in the configured order (others dropped)."""
    return sorted((k for k in DIMS if k in names), key=list(names).index)


def choose_group(
    topology: JobTopology, roots: Sequence[int], preference: Sequence[Dim]
) -> tuple[str, tuple[int, ...]]:
    """The parallel group to evict for these root ranks: ``(kind, sorted ranks)``."""
    if not roots:
        raise ValueError("no root ranks to evict a group for")
    kinds: list[Dim] = [k for k in preference if topology.size(k) > 1]
    if not kinds:
        kinds = [preference[0]]  # a 1x1x1 job: the rank's own "group"
    best: tuple[int, str, tuple[int, ...]] | None = None
    for k in kinds:
        groups = {tuple(topology.group(k, r)) for r in roots}
        if len(groups) == 1:
            return k, groups.pop()
        for g in sorted(groups):
            held = sum(1 for r in roots if r in g)
            if best is None or held > best[0]:
                best = (held, k, g)
    assert best is not None
    return best[1], best[2]
