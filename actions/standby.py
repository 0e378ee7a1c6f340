"""Warm standby pool (ByteRobust §6.2): its size, and the job specs a swap or refill produces.

The pool is sized by the binomial P99 rule (:func:`trainguard.detectors.planning.standby_pool_size`):
machine failures are independent, so simultaneous failures of an ``n``-machine job follow
Binomial(n, p_daily), and the pool holds its 99th percentile.  Standbys are pre-started by the
executor and listed in the job's :class:`~trainguard.schemas.control.JobSpec` (``standbys``); on eviction
they take the evicted machines' places (same machine index, so rank placement is unchanged), and
the pool is refilled after the job restarted.
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
