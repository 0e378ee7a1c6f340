"""Benchmark: topology-aware standby choice (the placement planner) against first-free.

**Cluster.**  ``--pods`` pods of ``--racks`` racks; a 1,200-machine job (TP8 / PP8 / DP150 on
8-GPU machines: 9,600 GPUs) placed as Arnold would: each DP group (one pipeline stage of every
replica) in one pod, its racks filled in order, so every DP group spans 1 pod and every PP group
all 8 (the best this shape allows: a pod's 150 job machines are one DP group).  Each rack also
holds ``--spares-per-rack`` free machines.  Names say where a machine is (``p3-r07-n12``).

**Failures.**  ``--recoveries`` recoveries that swap machines out, drawn (``--seed``) from the
incidents of ByteRobust's Table 1 that end with machines leaving: one machine for a CUDA error,
InfiniBand error, kernel panic, GPU memory error, GPU unavailable, disk fault or a NaN localised
by replay (22,229 incidents), a whole PP group -- over-eviction, §5/§9 -- for a job hang or an
MFU decline (5,948).  Every such incident is counted as an eviction (an upper bound on churn:
some CUDA errors are user code and end in a rollback).  The failing machine is uniform over the
job (failures are independent, §6.2).  Evicted machines come back to the free pool, repaired,
``--repair-after`` recoveries later (earlier when no free machine is left).

**Policies**, replaying the same sequence:

* ``first_free`` -- TrainGuard before the planner: a swap takes the pool's first standbys, the
  pool is refilled with the first free machines by name (the Kubernetes executor's order);
* ``planner`` -- every swap by :func:`trainguard.detectors.placement.choose_replacements`, every refill by
  :func:`trainguard.detectors.placement.place_standbys` (what the action service does).

A pool too small for a swap gets the shortfall first (each policy its own way), as the service
provisions it.  Printed: the largest DP and PP group spread (pods) after all recoveries, and the
planner's time per swap decision (goal: <= 50 ms).

Usage: ``PYTHONPATH=. python bench/placement_bench.py [--recoveries 100] [--seed 0] [--json]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainguard.detectors.placement import (  # noqa: E402 -- after the path tweak, so it runs from a checkout
    Groups,
    PlacementConfig,
    choose_replacements,
    first_free,
    measure,
    place_standbys,
)
from trainguard.schemas.network import MachinePosition  # noqa: E402
from trainguard.schemas.topology import JobTopology  # noqa: E402

#: ByteRobust Table 1: incidents after which machines leave the job, by how many leave.
ONE_MACHINE = {
    "cuda_error": 19_968,
    "infiniband_error": 1_599,
    "os_kernel_panic": 203,
    "gpu_memory_error": 188,
    "nan_value": 148,  # dual-phase replay localises one machine
    "gpu_unavailable": 76,
    "disk_fault": 47,
}
PP_GROUP = {"job_hang": 5_506, "mfu_decline": 442}  # stack aggregation over-evicts a pipeline


@dataclass(frozen=True)
class Cluster:
    """Where every machine sits, the job's initial machines per slot, the spare machines."""

    topology: JobTopology
    positions: dict[str, MachinePosition]
    job: list[str]
    spares: list[str]


def build_cluster(args: argparse.Namespace) -> Cluster:
    t = JobTopology(job="bench", tp=args.tp, pp=args.pp, dp=args.dp, ranks_per_machine=args.gpus_per_machine)
    n, racks = t.num_machines, args.pods * args.racks
    per_rack = -(-n // racks)  # job machines per rack
    positions: dict[str, MachinePosition] = {}
    job: list[str] = []
    spares: list[str] = []
    for r in range(racks):
        pod, rack = divmod(r, args.racks)
        take = min(per_rack, n - len(job))
        for i in range(take + args.spares_per_rack):
            name = f"p{pod}-r{rack:02d}-n{i:02d}"
            positions[name] = MachinePosition(pod=f"p{pod}", rack=f"r{rack:02d}")
            (job if i < take else spares).append(name)
    if len(job) < n:
        raise SystemExit(f"{args.pods} pods x {args.racks} racks cannot hold {n} machines")
    return Cluster(t, positions, job, spares)


def failure_sequence(groups: Groups, count: int, seed: int) -> list[tuple[str, list[int]]]:
    """``count`` recoveries: (incident kind, slots that leave)."""
    rnd = random.Random(seed)
    kinds = {**ONE_MACHINE, **PP_GROUP}
    names, weights = list(kinds), list(kinds.values())
    _, pp_of = groups.member_of()
    out = []
    for _ in range(count):
        kind = rnd.choices(names, weights)[0]
        slot = rnd.randrange(groups.n_slots)
        slots = list(groups.pp[pp_of[slot][0]]) if kind in PP_GROUP and pp_of[slot] else [slot]
        out.append((kind, slots))
    return out


@dataclass
class Policy:
    """One policy's copy of the cluster state as the recoveries change it."""

    name: str
    cluster: Cluster
    groups: Groups
    pool_size: int
    cfg: PlacementConfig
    repair_after: int
    job: list[str] = field(default_factory=list)
    pool: list[str] = field(default_factory=list)
    free: list[str] = field(default_factory=list)
    repairing: list[tuple[int, list[str]]] = field(default_factory=list)
    decision_ms: list[float] = field(default_factory=list)
    refill_ms: list[float] = field(default_factory=list)
    methods: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.job = list(self.cluster.job)
        self.free = sorted(self.cluster.spares)
        self.pool = self.provision(self.pool_size)

    @property
    def planned(self) -> bool:
        return self.name == "planner"

    def provision(self, count: int) -> list[str]:
        """``count`` free machines become standbys (taken out of the free list)."""
        if self.planned:
            t0 = time.perf_counter()
            new = place_standbys(self.free, count, self.job, self.cluster.positions, held=self.pool)
            self.refill_ms.append((time.perf_counter() - t0) * 1000)
        else:
            new = self.free[:count]
        self.free = [m for m in self.free if m not in new]
        return new

    def recover(self, step: int, slots: list[int]) -> None:
        leaving = [self.job[s] for s in slots]
        while len(self.pool) + len(self.free) < len(leaving) and self.repairing:
            # Out of machines: the longest-repaired ones come back early (a cluster would wait).
            self.free = sorted([*self.free, *self.repairing.pop(0)[1]])
        short = len(self.pool) < len(leaving)
        if self.planned:
            # Short of standbys, the service lets the planner pick the shortfall among the free
            # machines too (the pool's first), and provisions those.
            candidates, prefer = ([*self.pool, *self.free], set(self.pool)) if short else (self.pool, None)
            t0 = time.perf_counter()
            r = choose_replacements(
                self.job, self.groups, leaving, candidates, self.cluster.positions, self.cfg, prefer=prefer
            )
            self.decision_ms.append((time.perf_counter() - t0) * 1000)
            self.methods[r.method] = self.methods.get(r.method, 0) + 1
            chosen = list(r.chosen)
        else:
            if short:
                self.pool += self.provision(len(leaving) - len(self.pool))
            chosen = first_free(self.pool, len(leaving))
        for s, new in zip(slots, chosen, strict=True):
            self.job[s] = new
        self.pool = [m for m in self.pool if m not in chosen]
        self.free = [m for m in self.free if m not in chosen]
        self.repairing.append((step, leaving))
        back = [m for done, ms in self.repairing if done <= step - self.repair_after for m in ms]
        self.repairing = [(done, ms) for done, ms in self.repairing if done > step - self.repair_after]
        self.free = sorted([*self.free, *back])
        self.pool += self.provision(self.pool_size - len(self.pool))


def summary(p: Policy) -> dict[str, Any]:
    s = measure(p.job, p.groups, p.cluster.positions)
    pods = [p.cluster.positions[m].pod for m in p.job]
    dp = [len({pods[x] for x in g}) for g in p.groups.dp]
    return {
        "max_dp_spread": s.dp,
        "max_pp_spread": s.pp,
        "mean_dp_spread": statistics.fmean(dp),
        "dp_groups_over_one_pod": sum(n > 1 for n in dp),
        "objective": s.objective(p.cfg.alpha, p.cfg.beta),
    }


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    cluster = build_cluster(args)
    groups = Groups.of(cluster.topology)
    cfg = PlacementConfig(alpha=args.alpha, beta=args.beta)
    seq = failure_sequence(groups, args.recoveries, args.seed)
    policies = [
        Policy(name, cluster, groups, args.standbys, cfg, args.repair_after)
        for name in ("first_free", "planner")
    ]
    for p in policies:
        for step, (_kind, slots) in enumerate(seq):
            p.recover(step, slots)
    ff, planner = policies
    out = {
        "first_free": summary(ff),
        "planner": summary(planner),
        "ms_per_decision": statistics.fmean(planner.decision_ms) if planner.decision_ms else 0.0,
    }
    t = cluster.topology
    groups_evicted = sum(len(s) > 1 for _, s in seq)
    log(
        f"placement bench: {t.num_machines} machines ({t.world_size} GPUs), {args.pods} pods x "
        f"{args.racks} racks, TP{t.tp} PP{t.pp} DP{t.dp}, {len(cluster.spares)} spare machines, "
        f"pool {args.standbys}, {args.recoveries} recoveries (seed {args.seed}): "
        f"{args.recoveries - groups_evicted} single machines, {groups_evicted} PP groups"
    )
    log(
        f"{'policy':<11} {'max DP':>6} {'max PP':>6} {'mean DP':>8} {'DP groups >1 pod':>17} {'objective':>9}"
    )
    for p in policies:
        s = out[p.name]
        log(
            f"{p.name:<11} {s['max_dp_spread']:>6} {s['max_pp_spread']:>6} {s['mean_dp_spread']:>8.2f} "
            f"{s['dp_groups_over_one_pod']:>17} {s['objective']:>9g}"
        )
    ms = planner.decision_ms or [0.0]
    log(
        f"planner: {out['ms_per_decision']:.2f} ms per decision (median {statistics.median(ms):.2f}, "
        f"max {max(ms):.2f}; {planner.methods}), "
        f"{statistics.fmean(planner.refill_ms or [0.0]):.2f} ms per pool refill"
    )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=8)
    ap.add_argument("--racks", type=int, default=10, help="racks per pod")
    ap.add_argument("--spares-per-rack", type=int, default=2)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--dp", type=int, default=150)
    ap.add_argument("--gpus-per-machine", type=int, default=8)
    ap.add_argument("--standbys", type=int, default=8, help="warm standby pool size (one per pod by default)")
    ap.add_argument("--recoveries", type=int, default=100)
    ap.add_argument(
        "--repair-after", type=int, default=20, help="recoveries until an evicted machine is back"
    )
    ap.add_argument("--alpha", type=float, default=1.0, help="weight of the max DP-group spread")
    ap.add_argument("--beta", type=float, default=1.0, help="weight of the max PP-group spread")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.json:
        out = run(args, log=lambda _line: None)
        keys = ("max_dp_spread", "max_pp_spread")
        print(
            json.dumps(
                {
                    "first_free": {k: out["first_free"][k] for k in keys},
                    "planner": {k: out["planner"][k] for k in keys},
                    "ms_per_decision": round(out["ms_per_decision"], 3),
                }
            )
        )
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
