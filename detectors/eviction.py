"""What to evict for a set of suspect ranks (ByteRobust §5 over-eviction), fitted to the job's shape.

Shared by the analyses that name suspects (py-spy stacks, Flight Recorder dumps).  Over-eviction
evicts the parallel group around the suspects, because which member of a small group (a TP group
on one machine, a pipeline over a few) is at fault is uncertain.  :func:`choose_group` picks that
group: the first kind in the preference order with one group holding every suspect; when no kind
does, the group holding the most suspects (ties: the earlier kind, then the lower ranks).

A group is only worth evicting while it is a small part of the job.  :func:`choose_eviction`
applies the rule of ``docs/design/over-eviction.md``:

* the group spans every machine of the job (pure DDP: its one DP group; a pipeline laid over
  every machine; any group of a 1- or 2-machine job), or more than ``max_group_share`` of them:
  evict only the suspects' own machines (kind ``machine``), the group named as not evicted;
* the suspects' own machines are every machine of the job: evict nothing -- no machine is
  singled out, and replacing them all is a restart on new machines; a hang then restarts in
  place (:meth:`trainguard.detectors.capture.Capture.analyze`).

>>> from trainguard.schemas.topology import JobTopology
>>> t = JobTopology(job="j", tp=2, pp=2, dp=2, ranks_per_machine=2)
>>> choose_group(t, [5], ["pp", "tp", "dp"])
('pp', (1, 5))
>>> choose_group(t, [4, 5], ["pp", "tp", "dp"])
('tp', (4, 5))
>>> choose_eviction(t, [5], ["pp", "tp", "dp"], max_group_share=0.5).machines  # 2 of 4 machines
(0, 2)
>>> ddp = JobTopology(job="ddp", dp=5, ranks_per_machine=1)  # plain DDP on 5 machines
>>> ev = choose_eviction(ddp, [1], ["pp", "tp", "dp"], max_group_share=0.5)
>>> ev.kind, ev.machines, ev.not_evicted.kind
('machine', (1,), 'dp')
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.schemas.topology import DIMS, Dim, JobTopology

#: the kind of an eviction narrowed to the suspects' own machines.
MACHINE = "machine"


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
    """The parallel group around these root ranks: ``(kind, sorted ranks)``."""
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


@dataclass(frozen=True)
class ParallelGroup:
    """A parallel group of a job: its kind and ranks."""

    kind: str
    ranks: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "ranks": list(self.ranks)}


@dataclass(frozen=True)
class Eviction:
    """What to evict for a set of suspects: a parallel group, the suspects' machines, or nothing."""

    #: ``tp`` | ``dp`` | ``pp``: the group; ``machine``: the suspects' machines; None: nothing.
    kind: str | None
    ranks: tuple[int, ...]
    machines: tuple[int, ...]
    #: why the chosen group was not evicted (the rule and the group); "" when it is evicted.
    why: str = ""
    #: the parallel group chosen around the suspects, when it was not evicted.
    not_evicted: ParallelGroup | None = None


def choose_eviction(
    topology: JobTopology, suspects: Sequence[int], preference: Sequence[Dim], max_group_share: float
) -> Eviction:
    """The eviction for these suspect ranks: their parallel group (:func:`choose_group`) unless it
    spans every machine of the job or more than ``max_group_share`` of them (module docstring)."""
    kind, group = choose_group(topology, suspects, preference)
    machines = tuple(topology.machines_of(list(group)))
    total = topology.num_machines
    if len(machines) < total and len(machines) / total <= max_group_share:
        return Eviction(kind, group, machines)
    if len(machines) == total:
        rule = f"the {kind} group {_short(group)} spans every machine of the job ({total} of {total})"
    else:
        rule = (
            f"the {kind} group {_short(group)} spans {len(machines)} of the job's {total} machines, "
            f"more than max_group_share {max_group_share:g}"
        )
    spared = ParallelGroup(kind, group)
    own = tuple(topology.machines_of(list(suspects)))
    if len(own) == total:
        why = (
            f"{rule}, and the suspects {_short(sorted(suspects))} are on every machine of the job: "
            "no machine is singled out, nothing is evicted"
        )
        return Eviction(None, (), (), why, spared)
    ranks = tuple(r for m in own for r in topology.ranks_of_machine(m))
    why = f"{rule}: only the suspects' machine(s) {list(own)} are evicted"
    return Eviction(MACHINE, ranks, own, why, spared)


def describe(kind: str | None, ranks: Sequence[int], machines: Sequence[int]) -> str:
    """An eviction in words, for the command line: its group and machines, or "nothing"."""
    if kind is None:
        return "nothing"
    if kind == MACHINE:
        return f"the suspects' machine(s) {list(machines)} (ranks {_short(ranks)})"
    return f"{kind} group {list(ranks)} on machines {list(machines)}"


def _short(ranks: Sequence[int], limit: int = 16) -> str:
    shown = ", ".join(map(str, ranks[:limit]))
    return f"[{shown}{', ...' if len(ranks) > limit else ''}]"
