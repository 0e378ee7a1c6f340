"""Warm standby pool (ByteRobust §6.2): its size, and the job specs a swap or refill produces.

The pool is sized by the binomial P99 rule (:func:`trainguard.detectors.planning.standby_pool_size`):
machine failures are independent, so simultaneous failures of an ``n``-machine job follow
Binomial(n, p_daily), and the pool holds its 99th percentile.  Standbys are pre-started by the
executor and listed in the job's :class:`~trainguard.schemas.control.JobSpec` (``standbys``); on eviction
they take the evicted machines' places (same machine index, so rank placement is unchanged), and
the pool is refilled after the job restarted.  An operator puts machines into the pool by hand
with ``trainguard actions add-standby`` / ``return-node`` (:func:`offer_problems` checks them).
"""

from __future__ import annotations

from dataclasses import replace

from trainguard.actions.config import ActionsConfig
from trainguard.detectors.planning import standby_pool_size
from trainguard.schemas.control import JobSpec


def machine_names(spec: JobSpec) -> list[str]:
    """The job's machine names in index order (``machine-<i>`` where the spec names none)."""
    t = spec.topology
    return list(t.machines) or [t.machine_name(i) for i in range(t.num_machines)]


def pool_target(cfg: ActionsConfig, n_machines: int) -> int:
    """Standbys a job of ``n_machines`` keeps warm."""
    return max(cfg.min_standbys, standby_pool_size(n_machines, cfg.standby_p_daily, cfg.standby_quantile))


def swapped(spec: JobSpec, replaces: list[str], standbys: list[str], ts_ms: int) -> JobSpec:
    """``spec`` with each machine of ``replaces`` swapped for the standby at the same position.

    >>> from trainguard.schemas.topology import JobTopology
    >>> t = JobTopology(job="j", ranks_per_machine=1, dp=3, machines=["a", "b", "c"])
    >>> s = swapped(JobSpec(job="j", ts_ms=1, topology=t, standbys=["s0", "s1"]), ["b"], ["s0"], 2)
    >>> s.topology.machines, s.standbys
    (['a', 's0', 'c'], ['s1'])
    """
    if len(replaces) != len(standbys):
        raise ValueError(f"{len(replaces)} machines to replace but {len(standbys)} standbys")
    mapping = dict(zip(replaces, standbys, strict=True))
    machines = [mapping.get(m, m) for m in machine_names(spec)]
    left = [s for s in spec.standbys if s not in standbys]
    return replace(spec, ts_ms=ts_ms, topology=replace(spec.topology, machines=machines), standbys=left)


def refilled(spec: JobSpec, new: list[str], ts_ms: int) -> JobSpec:
    return replace(spec, ts_ms=ts_ms, standbys=[*spec.standbys, *(s for s in new if s not in spec.standbys)])


#: how an operator puts a machine into a job's pool (``trainguard actions add-standby`` /
#: ``return-node``): a machine new to the job, or one it evicted and that was repaired.
OFFER_KINDS = ("standby", "returned")


def offer_problems(
    job: str, spec: JobSpec | None, machines: list[str], evicted: set[str], kind: str
) -> list[str]:
    """Why ``machines`` cannot go into ``job``'s standby pool as ``kind`` (empty: they can).

    A machine the job runs on is no standby.  A machine the job evicted comes back only as
    ``returned`` -- the operator's word that it was repaired -- and only an evicted one can be
    returned (it may still be listed in the job's spec: the recovery held for want of a spare is
    the one replacing it).

    >>> from trainguard.schemas.topology import JobTopology
    >>> t = JobTopology(job="j", ranks_per_machine=1, dp=2, machines=["a", "b"])
    >>> spec = JobSpec(job="j", ts_ms=1, topology=t)
    >>> offer_problems("j", spec, ["b"], {"b"}, "returned")
    []
    >>> print(offer_problems("j", spec, ["a", "c"], set(), "standby")[0])
    a is an active machine of job j, not a standby
    >>> print(offer_problems("j", spec, ["c"], {"b"}, "returned")[0])
    c was not evicted from job j (evicted: ['b']); add a healthy machine with ...
    """
    if kind not in OFFER_KINDS:
        raise ValueError(f"offer kind {kind!r} is not one of {OFFER_KINDS}")
    if spec is None:
        return [f"no JobSpec of job {job!r} is known to the action service (check --job and the state dir)"]
    running = set(machine_names(spec))
    out = []
    for m in machines:
        if not m.strip():
            out.append("a machine name is empty")
        elif kind == "returned" and m not in evicted:
            out.append(
                f"{m} was not evicted from job {job} (evicted: {sorted(evicted)}); add a healthy "
                f"machine with `trainguard actions add-standby --job {job} {m}`"
            )
        elif kind == "standby" and m in evicted:
            out.append(
                f"{m} was evicted from job {job}; once it is repaired, give it back with "
                f"`trainguard actions return-node --job {job} {m}`"
            )
        elif kind == "standby" and m in running:
            out.append(f"{m} is an active machine of job {job}, not a standby")
    return out
