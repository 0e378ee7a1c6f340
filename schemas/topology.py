"""Job topology: 3D-parallel layout of a training job and the rank -> machine map.

A job with tensor (TP), pipeline (PP) and data (DP) parallel sizes has ``tp * pp * dp`` ranks.
``order`` lists the dimensions from fastest- to slowest-varying, as Megatron-LM's ``--order``
does; its default ``tp-dp-pp`` gives ``rank = tp_i + TP * dp_i + TP * DP * pp_i``.
Machines hold ``ranks_per_machine`` consecutive ranks (``machine = rank // ranks_per_machine``),
and ``machines`` optionally names them (node names in the cluster).

The parallel groups (the fault domains that ByteRobust over-evicts) are:

* the **TP group** of a rank: same dp and pp index, every tp index;
* the **DP group**: same tp and pp index, every dp index;
* the **PP group** (one pipeline): same tp and dp index, every pp stage.

>>> t = JobTopology(job="j", tp=2, pp=2, dp=2, ranks_per_machine=4)
>>> t.coords(5)
Coords(tp=1, dp=0, pp=1)
>>> t.group("pp", 5), t.group("dp", 5), t.group("tp", 5)
([1, 5], [5, 7], [4, 5])
>>> t.machine_of(5), t.machines_of([1, 5])
(1, [0, 1])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from trainguard.schemas.limits import JOB, MAX_RANK, NODES
from trainguard.schemas.typecheck import bounds

Dim = Literal["tp", "dp", "pp"]
DIMS: tuple[Dim, ...] = ("tp", "dp", "pp")


class Coords(NamedTuple):
    tp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class JobTopology:
    """TP/PP/DP sizes, rank order and machine layout of one training job."""

    job: str = field(metadata=JOB)
    tp: int = field(default=1, metadata=bounds(1, 1 << 20))
    pp: int = field(default=1, metadata=bounds(1, 1 << 20))
    dp: int = field(default=1, metadata=bounds(1, 1 << 20))
    ranks_per_machine: int = field(default=8, metadata=bounds(1, 1 << 12))
    order: str = field(default="tp-dp-pp", metadata=bounds(max_len=8))
    #: node name of machine index i; empty means machines are known by index only.
    machines: list[str] = field(default_factory=list, metadata=NODES)

    def __post_init__(self) -> None:
        dims = self.order.split("-")
        if sorted(dims) != sorted(DIMS):
            raise ValueError(f"order {self.order!r} must be a permutation of tp, dp, pp (e.g. 'tp-dp-pp')")
        if self.world_size > MAX_RANK + 1:
            raise ValueError(f"tp * pp * dp = {self.world_size} ranks exceeds {MAX_RANK + 1}")
        if self.machines and len(self.machines) != self.num_machines:
            raise ValueError(
                f"machines lists {len(self.machines)} names but the job spans {self.num_machines} machines"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_machines(self) -> int:
        return -(-self.world_size // self.ranks_per_machine)

    def _dims(self) -> list[Dim]:
        return self.order.split("-")  # type: ignore[return-value]

    def size(self, dim: Dim) -> int:
        return int(getattr(self, dim))

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1}")
        out: dict[str, int] = {}
        rest = rank
        for dim in self._dims():
            n = self.size(dim)
            out[dim] = rest % n
            rest //= n
        return Coords(**out)

    def rank(self, tp: int, dp: int, pp: int) -> int:
        idx = {"tp": tp, "dp": dp, "pp": pp}
        rank, stride = 0, 1
        for dim in self._dims():
            rank += idx[dim] * stride
            stride *= self.size(dim)
        return rank

    def group(self, kind: Dim, rank: int) -> list[int]:
        """Ranks of ``rank``'s ``kind`` group (the ranks that differ only in that index)."""
        c = self.coords(rank)._asdict()
        members = []
        for i in range(self.size(kind)):
            c[kind] = i
            members.append(self.rank(**c))
        return sorted(members)

    def groups(self, kind: Dim) -> list[list[int]]:
        """Every ``kind`` group of the job, each sorted, ordered by their first rank."""
        seen: set[int] = set()
        out = []
        for r in range(self.world_size):
            if r not in seen:
                g = self.group(kind, r)
                seen.update(g)
                out.append(g)
        return out

    def machine_of(self, rank: int) -> int:
        return rank // self.ranks_per_machine

    def machines_of(self, ranks: list[int] | set[int]) -> list[int]:
        return sorted({self.machine_of(r) for r in ranks})

    def ranks_of_machine(self, machine: int) -> list[int]:
        lo = machine * self.ranks_per_machine
        return list(range(lo, min(lo + self.ranks_per_machine, self.world_size)))

    def machine_name(self, machine: int) -> str:
        return self.machines[machine] if self.machines else f"machine-{machine}"

    def machine_index(self, name: str) -> int:
        if name in self.machines:
            return self.machines.index(name)
        raise KeyError(f"machine {name!r} is not part of job {self.job!r}")
