"""ByteRobust's planning helpers: warm-standby pool size, dual-phase replay, backup peers.

* :func:`standby_pool_size` -- §6.2: machine failures are independent, so simultaneous
  failures of an ``n``-machine job are Binomial(n, p_daily); keep the P99 of it warm.
* :func:`plan_dual_phase_replay` / :func:`locate_faulty_machine` -- §4.2 Algorithm 1: keep TP
  and PP, shrink DP, replay on horizontal groups ``floor(x / m)`` and vertical groups
  ``x mod n`` (``m = k * PP``, ``n = DP / k``, ``m <= n``); the failing horizontal group meets
  the failing vertical group in exactly one machine.
* :func:`backup_peers` / :func:`machine_backup_peers` -- §6.3: over-eviction removes whole
  parallel groups, so each rank backs its checkpoint up on a rank sharing none of its TP, PP
  and DP groups (and, per machine, on a machine sharing no group with any of its ranks).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from trainguard.schemas.topology import DIMS, Dim, JobTopology


class PlanningError(ValueError):
    """The requested plan is impossible (bad sizes, no valid peer, ambiguous replay result)."""


# --- warm standbys -----------------------------------------------------------------------------


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P[X <= k] for X ~ Binomial(n, p), summed exactly term by term (log space, no scipy).

    >>> round(binomial_cdf(1, 128, 1.2e-3), 4)
    0.9894
    """
    if not 0.0 <= p <= 1.0 or n < 0:
        raise PlanningError(f"need 0 <= p <= 1 and n >= 0, got p={p!r}, n={n!r}")
    if k < 0:
        return 0.0
    if k >= n or p == 0.0:
        return 1.0
    if p == 1.0:
        return 0.0
    lp, lq, lg = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    total = 0.0
    for i in range(k + 1):
        total += math.exp(lg - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq)
    return min(total, 1.0)


def standby_pool_size(n_machines: int, p_daily: float, quantile: float = 0.99) -> int:
    """Smallest ``k`` with P[Binomial(n_machines, p_daily) <= k] >= ``quantile``.

    >>> [standby_pool_size(n, 1.2e-3) for n in (128, 256, 512, 1024)]
    [2, 2, 3, 4]
    """
    if n_machines < 0 or not isinstance(n_machines, int):
        raise PlanningError(f"n_machines must be a non-negative integer, got {n_machines!r}")
    if not 0.0 < quantile < 1.0:
        raise PlanningError(f"quantile must be in (0, 1), got {quantile!r}")
    if not 0.0 <= p_daily <= 1.0:
        raise PlanningError(f"p_daily must be a probability, got {p_daily!r}")
    for k in range(n_machines + 1):
        if binomial_cdf(k, n_machines, p_daily) >= quantile:
            return k
    return n_machines


# --- dual-phase replay -------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayPlan:
    """Machine groups of the two replay phases (machines numbered 0..n_machines-1)."""

    n_machines: int
    pp: int
    dp: int
    k: int
    m: int
    n: int
    horizontal: tuple[tuple[int, ...], ...]
    vertical: tuple[tuple[int, ...], ...]


def valid_replay_ks(pp: int, dp: int) -> list[int]:
    """The ``k`` values with ``k | DP`` and ``k * PP <= DP / k`` (unique localisation).

    >>> valid_replay_ks(pp=2, dp=12)
    [1, 2]
    """
    return [k for k in range(1, dp + 1) if dp % k == 0 and k * pp <= dp // k]


def plan_dual_phase_replay(pp: int, dp: int, k: int = 1, n_machines: int | None = None) -> ReplayPlan:
    """Horizontal and vertical replay groups for a job of ``PP x DP`` machine slots.

    ``n_machines`` defaults to ``pp * dp`` (one TP group per machine); it must be a multiple of
    ``m`` so every horizontal group has ``m`` machines.

    >>> plan = plan_dual_phase_replay(pp=2, dp=12, k=2)   # Fig. 6: m = 4, n = 6, 24 machines
    >>> plan.m, plan.n, plan.horizontal[3], plan.vertical[1]
    (4, 6, (12, 13, 14, 15), (1, 7, 13, 19))
    """
    if min(pp, dp, k) < 1:
        raise PlanningError(f"pp, dp and k must be >= 1, got pp={pp}, dp={dp}, k={k}")
    if dp % k:
        raise PlanningError(f"k={k} must divide DP={dp} (n = DP / k)")
    m, n = k * pp, dp // k
    if m > n:
        raise PlanningError(
            f"m = k*PP = {m} exceeds n = DP/k = {n}: the intersection would not be unique; "
            f"valid k: {valid_replay_ks(pp, dp)}"
        )
    total = pp * dp if n_machines is None else n_machines
    if total < 1 or total % m:
        raise PlanningError(f"{total} machines cannot be split into horizontal groups of m={m}")
    horizontal = tuple(tuple(range(j * m, (j + 1) * m)) for j in range(total // m))
    vertical = tuple(tuple(range(j, total, n)) for j in range(min(n, total)))
    return ReplayPlan(total, pp, dp, k, m, n, horizontal, vertical)


def locate_faulty_machine(plan: ReplayPlan, failing_horizontal: int, failing_vertical: int) -> int:
    """The one machine in both failing groups (Algorithm 1, lines 9-11).

    >>> locate_faulty_machine(plan_dual_phase_replay(pp=2, dp=12, k=2), 3, 1)
    13
    """
    if not 0 <= failing_horizontal < len(plan.horizontal):
        raise PlanningError(f"no horizontal group {failing_horizontal} (0..{len(plan.horizontal) - 1})")
    if not 0 <= failing_vertical < len(plan.vertical):
        raise PlanningError(f"no vertical group {failing_vertical} (0..{len(plan.vertical) - 1})")
    both = set(plan.horizontal[failing_horizontal]) & set(plan.vertical[failing_vertical])
    if len(both) != 1:  # cannot happen for a plan built with m <= n; guards hand-made plans
        raise PlanningError(f"groups H{failing_horizontal} and V{failing_vertical} share {sorted(both)}")
    return both.pop()


def _single_failure(results: Mapping[int, bool] | Sequence[bool], phase: str) -> int:
    items = results.items() if isinstance(results, Mapping) else enumerate(results)
    failed = [g for g, ok in items if not ok]
    if len(failed) != 1:
        raise PlanningError(
            f"{phase} phase: expected exactly one failing group, got {failed or 'none'} "
            "(dual-phase replay assumes a single faulty machine)"
        )
    return failed[0]


def locate_from_results(
    plan: ReplayPlan,
    horizontal_ok: Mapping[int, bool] | Sequence[bool],
    vertical_ok: Mapping[int, bool] | Sequence[bool],
) -> int:
    """Faulty machine from per-group pass/fail results of both phases (True = replay passed)."""
    return locate_faulty_machine(
        plan, _single_failure(horizontal_ok, "horizontal"), _single_failure(vertical_ok, "vertical")
    )


# --- checkpoint backup peers ------------------------------------------------------------------


def _shares_group(t: JobTopology, a: int, b: int) -> bool:
    # Two ranks share a TP/DP/PP group iff they differ in at most one coordinate.
    ca, cb = t.coords(a), t.coords(b)
    return sum(x != y for x, y in zip(ca, cb, strict=True)) <= 1


def _shift_candidates(t: JobTopology) -> list[dict[Dim, int]]:
    """Uniform coordinate shifts moving every rank in >= 2 coordinates, half-sizes first."""
    sizes = {d: t.size(d) for d in DIMS}
    order: tuple[Dim, ...] = ("dp", "pp", "tp")  # the paper's Fig. 9 shifts DP and PP
    usable = [d for d in order if sizes[d] >= 2]
    out: list[dict[Dim, int]] = []
    for i, a in enumerate(usable):
        for b in usable[i + 1 :]:
            prefs = [(sizes[a] // 2, sizes[b] // 2)] + [
                (sa, sb)
                for sa in range(1, sizes[a])
                for sb in range(1, sizes[b])
                if (sa, sb) != (sizes[a] // 2, sizes[b] // 2)
            ]
            out.extend({a: sa, b: sb} for sa, sb in prefs)
    return out


def _apply(t: JobTopology, rank: int, shift: Mapping[Dim, int]) -> int:
    c = t.coords(rank)._asdict()
    for d, s in shift.items():
        c[d] = (c[d] + s) % t.size(d)
    return t.rank(**c)


def _rank_shift(t: JobTopology) -> dict[Dim, int]:
    cands = _shift_candidates(t)
    if not cands:
        raise PlanningError(
            f"job {t.job!r} (tp={t.tp}, pp={t.pp}, dp={t.dp}) has fewer than two parallel dimensions "
            "of size >= 2: "
            "every other rank shares a parallel group with it, so no cross-group backup peer exists "
            "(ByteRobust falls back to neighbouring machines for pure ZeRO/DP jobs)"
        )
    ranks = range(t.world_size)
    # Prefer a shift that also moves every rank to another machine: a backup on the same
    # machine dies with it.
    for s in cands[:64]:  # bounded: huge jobs must not try every shift
        if all(t.machine_of(_apply(t, r, s)) != t.machine_of(r) for r in ranks):
            return s
    return cands[0]


def backup_peers(topology: JobTopology) -> dict[int, int]:
    """rank -> backup rank sharing none of its TP, PP and DP groups.

    The mapping is a uniform shift of two coordinates (half the dimension size when possible),
    so it is a permutation: every rank also holds exactly one peer's backup.

    >>> t = JobTopology(job="fig9", tp=2, pp=4, dp=2, ranks_per_machine=2)
    >>> p = backup_peers(t)
    >>> p[8], p[9], p[2], p[3]
    (2, 3, 8, 9)
    """
    t = topology
    shift = _rank_shift(t)
    peers = {r: _apply(t, r, shift) for r in range(t.world_size)}
    assert not any(_shares_group(t, r, p) for r, p in peers.items())  # by construction
    return peers


def _forbidden_machines(t: JobTopology, machine: int) -> set[int]:
    ranks: set[int] = set()
    for r in t.ranks_of_machine(machine):
        for d in DIMS:
            ranks.update(t.group(d, r))
    return set(t.machines_of(ranks)) | {machine}


def machine_backup_peers(topology: JobTopology) -> dict[int, int]:
    """machine -> backup machine holding no rank that shares a parallel group with its ranks.

    Uses the rank-level peers when they map whole machines onto whole machines (Fig. 9: the
    machine of ranks 8-9 backs up to the machine of ranks 2-3), else the most balanced valid
    assignment; raises :class:`PlanningError` naming the machines without any valid peer.

    >>> machine_backup_peers(JobTopology(job="fig9", tp=2, pp=4, dp=2, ranks_per_machine=2))[4]
    1
    """
    t = topology
    n = t.num_machines
    allowed = {m: sorted(set(range(n)) - _forbidden_machines(t, m)) for m in range(n)}
    stuck = [m for m, ok in allowed.items() if not ok]
    if stuck:
        raise PlanningError(
            f"machines {stuck} of job {t.job!r} share a parallel group with every other machine; "
            "no cross-group backup machine exists (more machines or another layout is needed)"
        )
    try:
        rank_peers = backup_peers(t)
        image = {m: set(t.machines_of([rank_peers[r] for r in t.ranks_of_machine(m)])) for m in range(n)}
        if all(len(v) == 1 and next(iter(v)) in allowed[m] for m, v in image.items()):
            return {m: next(iter(v)) for m, v in image.items()}
    except PlanningError:
        pass
    # Balanced greedy: the most constrained machine picks first, the least loaded peer wins.
    load = dict.fromkeys(range(n), 0)
    out = {}
    for m in sorted(range(n), key=lambda x: (len(allowed[x]), x)):
        peer = min(allowed[m], key=lambda x: (load[x], (x - m) % n))
        out[m] = peer
        load[peer] += 1
    return dict(sorted(out.items()))
