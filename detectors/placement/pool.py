"""Where to hold the warm standbys: every pod of the job with a standby in it, then by need.

A standby helps the Arnold objective only if it sits in the pod of the machine it replaces:
one from another pod widens that machine's DP and PP groups by a pod.  :func:`place_standbys`
picks which free machines become standbys (the pool's size is ByteRobust's binomial P99 rule,
:func:`trainguard.detectors.planning.standby_pool_size`; this decides only *where*):

1. **cover** -- pods of the job without a standby yet, the pod with most job machines first;
2. **share** -- then the pod with the highest ``job machines / (standbys + 1)`` (D'Hondt's rule:
   standbys in proportion to how many machines may fail there);
3. inside a pod, the rack holding fewest standbys (one leaf switch down must not take a pod's
   whole pool with it), then the rack with most job machines, then the machine name.

Free machines in no pod of the job come last, in name order (a far standby beats none).

>>> from trainguard.schemas.network import MachinePosition as P
>>> pos = {"a": P("p1", "r1"), "b": P("p1", "r1"), "c": P("p2", "r1"),
...        "f1": P("p1", "r1"), "f2": P("p1", "r2"), "f3": P("p2", "r1"), "f4": P("p3", "r1")}
>>> place_standbys(["f1", "f2", "f3", "f4"], 3, ["a", "b", "c"], pos)
['f1', 'f3', 'f2']
>>> uncovered_pods(["a", "b", "c"], ["f1"], pos)
['p2']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from trainguard.schemas.network import MachinePosition


def _pod(name: str, positions: Mapping[str, MachinePosition]) -> str:
    p = positions.get(name)
    return p.pod if p is not None else ""


def _rack(name: str, positions: Mapping[str, MachinePosition]) -> str:
    p = positions.get(name)
    return p.rack_key if p is not None and p.pod else ""


def _count(names: Sequence[str], key: Mapping[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in names:
        if key[n]:
            out[key[n]] = out.get(key[n], 0) + 1
    return out


def place_standbys(
    free: Sequence[str],
    count: int,
    job_machines: Sequence[str],
    positions: Mapping[str, MachinePosition],
    held: Sequence[str] = (),
) -> list[str]:
    """``count`` machines of ``free`` to start as standbys, in the order they were picked.

    ``held`` are the standbys the job has already (they count as covering their pods).
    """
    names = [*dict.fromkeys(free)]
    every = [*names, *job_machines, *held]
    pod = {n: _pod(n, positions) for n in every}
    rack = {n: _rack(n, positions) for n in every}
    demand = _count(job_machines, pod)
    rack_demand = _count(job_machines, rack)
    have = _count(held, pod)
    rack_have = _count(held, rack)
    left: dict[str, list[str]] = {}
    for n in sorted(names):
        left.setdefault(pod[n] if pod[n] in demand else "", []).append(n)
    out: list[str] = []
    while len(out) < min(count, len(names)):
        open_pods = [p for p in left if p and left[p]]
        if open_pods:
            # Uncovered pods first (by demand), then D'Hondt quotients; the pod name breaks ties.
            p = min(
                open_pods,
                key=lambda p: (have.get(p, 0) > 0, -demand[p] / (have.get(p, 0) + 1), p),
            )
            pick = min(left[p], key=lambda n: (rack_have.get(rack[n], 0), -rack_demand.get(rack[n], 0), n))
        else:
            p = ""
            pick = left[""][0]
        left[p].remove(pick)
        out.append(pick)
        if pod[pick]:
            have[pod[pick]] = have.get(pod[pick], 0) + 1
        if rack[pick]:
            rack_have[rack[pick]] = rack_have.get(rack[pick], 0) + 1
    return out


def uncovered_pods(
    job_machines: Sequence[str], standbys: Sequence[str], positions: Mapping[str, MachinePosition]
) -> list[str]:
    """Pods holding machines of the job but no standby, sorted."""
    job = {_pod(n, positions) for n in job_machines} - {""}
    return sorted(job - {_pod(n, positions) for n in standbys})
