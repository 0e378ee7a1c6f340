"""A job's communication groups over machine slots, and how many pods (racks) each one spans.

A machine *slot* is a machine index of the job (:class:`~trainguard.schemas.topology.JobTopology`): a
standby that replaces a machine takes its slot, so the groups never change, only which machine
fills each slot.  A group's **spread** is the number of distinct pods its machines sit in; the
Arnold objective is ``alpha * max DP-group spread + beta * max PP-group spread``.

A machine whose pod is not known counts as a pod of its own (the pessimistic reading: nothing
says it is near anything), and likewise for racks.

>>> from trainguard.schemas.topology import JobTopology
>>> g = Groups.of(JobTopology(job="j", tp=2, pp=2, dp=2, ranks_per_machine=2))
>>> g.dp, g.pp
(((0, 1), (2, 3)), ((0, 2), (1, 3)))
>>> pos = {"a": MachinePosition("p1", "r1"), "b": MachinePosition("p1", "r2"),
...        "c": MachinePosition("p2", "r1")}
>>> measure(["a", "b", "c", "d"], g, pos)
Spread(dp=2, pp=2, dp_racks=2, pp_racks=2)
>>> measure(["a", "b", "c", "d"], g, pos).objective(alpha=1.0, beta=0.5)
3.0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from trainguard.schemas.network import MachinePosition
from trainguard.schemas.topology import DIMS, Dim, JobTopology


@dataclass(frozen=True)
class Groups:
    """The machine-slot groups of a job: each DP and PP group as sorted slot indices.

    Rank-level groups that land on the same machines are one machine-level group (with TP
    inside a machine, the TP ranks of a machine share their DP and PP groups' machines)."""

    n_slots: int
    dp: tuple[tuple[int, ...], ...]
    pp: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(topology: JobTopology) -> Groups:
        """The groups of ``topology`` (computed once per shape: a swap changes names, not shape)."""
        t = topology
        return _groups(t.tp, t.pp, t.dp, t.ranks_per_machine, t.order)

    @staticmethod
    def explicit(n_slots: int, dp: Sequence[Sequence[int]], pp: Sequence[Sequence[int]]) -> Groups:
        """Groups given as lists of slots (tests, or a layout :class:`JobTopology` cannot express)."""
        norm = [tuple(sorted(set(g))) for g in (*dp, *pp)]
        if any(not 0 <= s < n_slots for g in norm for s in g):
            raise ValueError(f"a group names a slot outside 0..{n_slots - 1}")
        return Groups(n_slots, tuple(norm[: len(dp)]), tuple(norm[len(dp) :]))

    def member_of(self) -> tuple[list[list[int]], list[list[int]]]:
        """slot -> indices of its DP groups, and of its PP groups."""
        return _member_of(self)


def _dims_in(order: str) -> list[Dim]:
    """The dimensions of a rank ``order`` string (``"tp-dp-pp"``), fastest-varying first."""
    return [d for name in order.split("-") for d in DIMS if d == name]


@lru_cache(maxsize=16)
def _groups(tp: int, pp: int, dp: int, rpm: int, order: str) -> Groups:
    t = JobTopology(job="shape", tp=tp, pp=pp, dp=dp, ranks_per_machine=rpm, order=order)
    # rank = sum(index[d] * stride[d]) with strides in ``order`` (fastest first), as
    # JobTopology.rank computes it; walking the indices directly is ~50x faster than coords().
    stride: dict[Dim, int] = {}
    step = 1
    for d in _dims_in(order):
        stride[d] = step
        step *= t.size(d)
    out: dict[Dim, tuple[tuple[int, ...], ...]] = {}
    kinds: tuple[Dim, Dim] = ("dp", "pp")
    for kind in kinds:
        a, b = (d for d in DIMS if d != kind)
        seen: set[tuple[int, ...]] = set()
        for i in range(t.size(a)):
            for j in range(t.size(b)):
                base = i * stride[a] + j * stride[b]
                ranks = range(base, base + t.size(kind) * stride[kind], stride[kind])
                seen.add(tuple(sorted({r // rpm for r in ranks})))
        out[kind] = tuple(sorted(seen))
    return Groups(t.num_machines, out["dp"], out["pp"])


@lru_cache(maxsize=16)
def _member_of(groups: Groups) -> tuple[list[list[int]], list[list[int]]]:
    dp: list[list[int]] = [[] for _ in range(groups.n_slots)]
    pp: list[list[int]] = [[] for _ in range(groups.n_slots)]
    for table, gs in ((dp, groups.dp), (pp, groups.pp)):
        for i, g in enumerate(gs):
            for s in g:
                table[s].append(i)
    return dp, pp


def pod_key(name: str, positions: Mapping[str, MachinePosition]) -> str:
    """``name``'s pod, or a pod of its own when not known ("?" cannot start a real pod name here)."""
    p = positions.get(name)
    return p.pod if p is not None and p.pod else f"?{name}"


def rack_key(name: str, positions: Mapping[str, MachinePosition]) -> str:
    """``name``'s rack qualified by its pod, or a rack of its own when not known."""
    p = positions.get(name)
    return p.rack_key if p is not None and p.pod and p.rack else f"?{name}"


@dataclass(frozen=True)
class Spread:
    """The largest pod spread of any DP and of any PP group (and the same for racks)."""

    dp: int
    pp: int
    dp_racks: int
    pp_racks: int

    def objective(self, alpha: float, beta: float) -> float:
        """Arnold's objective: ``alpha * max DP spread + beta * max PP spread``."""
        return alpha * self.dp + beta * self.pp

    def describe(self, after: Spread) -> str:
        """``dp_spread 3->2 pp_spread 2->2``: this spread, then ``after``."""
        return f"dp_spread {self.dp}->{after.dp} pp_spread {self.pp}->{after.pp}"


def spreads(gs: Sequence[Sequence[int]], keys: Sequence[str]) -> list[int]:
    """Distinct ``keys`` (pods or racks, per slot) of each group."""
    return [len({keys[s] for s in g}) for g in gs]


def measure(machines: Sequence[str], groups: Groups, positions: Mapping[str, MachinePosition]) -> Spread:
    """The spread of the job whose slot ``i`` holds ``machines[i]``."""
    if len(machines) != groups.n_slots:
        raise ValueError(f"{len(machines)} machines for {groups.n_slots} slots")
    pods = [pod_key(m, positions) for m in machines]
    racks = [rack_key(m, positions) for m in machines]
    return Spread(
        max(spreads(groups.dp, pods), default=0),
        max(spreads(groups.pp, pods), default=0),
        max(spreads(groups.dp, racks), default=0),
        max(spreads(groups.pp, racks), default=0),
    )
