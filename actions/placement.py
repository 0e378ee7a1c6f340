"""The action service's topology-aware choices: which standby fills which evicted machine's slot,
and which free machines become new standbys (:mod:`trainguard.detectors.placement` decides; this gathers).

Machine positions come from, in this order of precedence:

1. the job's :class:`~trainguard.schemas.control.JobSpec` (``positions``: what the launcher declared, and
   what earlier swaps learnt);
2. configuration (``actions.placement.positions``);
3. the executor, for the machines still unknown: an optional ``machine_positions(names)`` that
   returns ``{name: MachinePosition}`` (Kubernetes: node labels; Slurm: topology.conf).

With no candidate's pod known, a swap takes the standbys as before the planner did (ready ones
first, pool order).  Optional executor methods for provisioning: ``free_machines(job)`` (the
machines a new standby of the job could start on) and ``provision_standbys_on(job, machines,
ctx)`` (start standbys on exactly those); without both, the executor picks the machines itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

from trainguard.actions.executors.base import Executor, StepContext
from trainguard.actions.standby import machine_names
from trainguard.detectors.placement import (
    Groups,
    PlacementConfig,
    Replacement,
    choose_replacements,
    place_standbys,
)
from trainguard.schemas.control import JobSpec
from trainguard.schemas.network import MachinePosition

log = logging.getLogger(__name__)


def known_positions(
    cfg: PlacementConfig, executor: Executor, spec: JobSpec, names: Sequence[str]
) -> dict[str, MachinePosition]:
    """The positions of ``names`` that the spec, the configuration or the executor know."""
    out: dict[str, MachinePosition] = {}
    for n in names:
        p = spec.positions.get(n) or cfg.positions.get(n)
        if p is not None and p.known:
            out[n] = p
    missing = [n for n in dict.fromkeys(names) if n not in out]
    probe = getattr(executor, "machine_positions", None)
    if missing and callable(probe):
        try:
            found = probe(missing)
        except Exception as exc:  # a failed probe costs the topology awareness, not the step
            log.warning(
                "executor %s could not tell where %d machines sit: %s", executor.name, len(missing), exc
            )
        else:
            out.update({n: p for n, p in found.items() if n in missing and p.known})
    return out


def with_positions(spec: JobSpec, positions: dict[str, MachinePosition]) -> JobSpec:
    """``spec`` also carrying ``positions`` (the spec's own entries stay as they are)."""
    learnt = {n: p for n, p in positions.items() if n not in spec.positions}
    return replace(spec, positions={**spec.positions, **learnt}) if learnt else spec


@dataclass(frozen=True)
class Pick:
    """The standbys a swap takes (``chosen[i]`` replaces ``leaving[i]``) and why."""

    chosen: list[str]
    positions: dict[str, MachinePosition]
    replacement: Replacement
    ms: float

    def result(self, alpha: float = 1.0, beta: float = 1.0) -> dict[str, Any]:
        """For the swap step's recorded result (and from there, the postmortem)."""
        r = self.replacement
        return {
            "method": r.method,
            "dp_spread": [r.before.dp, r.after.dp],
            "pp_spread": [r.before.pp, r.after.pp],
            "objective": [r.before.objective(alpha, beta), r.after.objective(alpha, beta)],
            "positions_known": len(self.positions),
            "ms": round(self.ms, 3),
        }


def describe(result: dict[str, Any] | None) -> str:
    """A swap's placement result as ``dp_spread 3->2 pp_spread 2->2 (exact)`` (the job's widest
    DP and PP groups in pods, before -> after); "" for a result without one (an older record).

    >>> describe({"method": "exact", "dp_spread": [3, 2], "pp_spread": [2, 2]})
    'dp_spread 3->2 pp_spread 2->2 (exact)'
    """
    if not isinstance(result, dict) or "dp_spread" not in result:
        return ""
    (dp0, dp1), (pp0, pp1) = result["dp_spread"], result["pp_spread"]
    return f"dp_spread {dp0}->{dp1} pp_spread {pp0}->{pp1} ({result.get('method', '?')})"


def pick_standbys(
    cfg: PlacementConfig,
    executor: Executor,
    spec: JobSpec,
    leaving: Sequence[str],
    candidates: Sequence[str],
    prefer: Collection[str] | None,
) -> Pick:
    """Which of ``candidates`` replace ``leaving`` (``prefer``: the ones ready now)."""
    t0 = time.perf_counter()
    machines = machine_names(spec)
    # Read even when the planner is off: the spreads before and after are reported either way.
    positions = known_positions(cfg, executor, spec, [*machines, *candidates])
    r = choose_replacements(
        machines, Groups.of(spec.topology), leaving, candidates, positions, cfg, prefer=prefer
    )
    return Pick(list(r.chosen), positions, r, (time.perf_counter() - t0) * 1000)


def provision(
    cfg: PlacementConfig,
    executor: Executor,
    spec: JobSpec,
    count: int,
    ctx: StepContext,
    leaving: Sequence[str] = (),
    pool: Sequence[str] = (),
) -> list[str]:
    """Start ``count`` new standbys for the job, on machines the planner picks when the executor
    lets the service choose them and their positions are known, else wherever the executor
    puts them.  For a swap short of standbys (``leaving``: the machines to replace, ``pool``:
    the standbys it has) the planner picks the machines that best replace ``leaving`` together
    with the pool; to refill the pool, :func:`place_standbys`."""
    free_of = getattr(executor, "free_machines", None)
    start_on = getattr(executor, "provision_standbys_on", None)
    chosen: list[str] = []
    if cfg.enabled and callable(free_of) and callable(start_on):
        try:
            chosen = _where(cfg, executor, spec, count, list(free_of(spec.job)), leaving, pool)
        except Exception as exc:  # a failed probe costs the choice of machines, not the standbys
            log.warning("choosing where the standbys of %s start failed: %s", spec.job, exc)
    if callable(start_on) and chosen:
        started: list[str] = start_on(spec.job, chosen, ctx)
        return started
    new: list[str] = executor.provision_standbys(spec.job, count, ctx)
    return new


def _where(
    cfg: PlacementConfig,
    executor: Executor,
    spec: JobSpec,
    count: int,
    free: list[str],
    leaving: Sequence[str],
    pool: Sequence[str],
) -> list[str]:
    """The ``count`` free machines to start standbys on ([] when their positions are not known)."""
    free = [m for m in free if m not in spec.standbys and m not in pool]
    machines = machine_names(spec)
    positions = known_positions(cfg, executor, spec, [*machines, *spec.standbys, *free])
    if not any(m in positions for m in free):
        return []
    if leaving:
        groups = Groups.of(spec.topology)
        r = choose_replacements(machines, groups, leaving, [*pool, *free], positions, cfg, prefer=set(pool))
        chosen = [m for m in r.chosen if m not in pool][:count]
    else:
        chosen = place_standbys(free, count, machines, positions, held=spec.standbys)
    return chosen if len(chosen) == count else []
