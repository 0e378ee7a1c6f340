"""Benchmark: over-eviction analysis of a 9,600-rank job (tp8 pp16 dp75) on one core.

The dumps are synthetic in layout but real in content: the stack classes of the captured gloo
fixtures (``tests/fixtures/stacks``) are replicated over the large topology as a hang would
lay them out -- one rank busy in compute, its TP peers in the TP all-reduce, the earlier stages
of its pipeline in ``recv_backward``, the later ones in ``recv_forward``, every other DP
replica in the DP grad all-reduce -- and every rank also has an idle DataLoader worker dump.
Each copy gets its own pid, so 19,200 distinct dump texts are parsed.

Parse (dump text -> records) and classify (records -> verdict) are timed separately, for the
text and the ``--json`` format, best of ``--repeat`` runs, pinned to one CPU core.

Usage: ``PYTHONPATH=. python bench/over_eviction_bench.py [--repeat 5] [--budget-s 1.0] [--check]``
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainguard.detectors.stacks import (  # noqa: E402 -- after the path tweak, so it runs from a checkout
    DumpName,
    DumpParser,
    OverEvictionClassifier,
    OverEvictionResult,
    Role,
    Round,
    StackReader,
    collect_round,
)
from trainguard.schemas.enums import Verdict  # noqa: E402
from trainguard.schemas.topology import JobTopology  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "stacks"
TOPO = JobTopology(job="bench", tp=8, pp=16, dp=75, ranks_per_machine=8)
ROOT_RANK = TOPO.rank(tp=3, dp=37, pp=7)
T = TypeVar("T")

# What each rank shows in the hang, as (role, pipeline peer or group kind) of a real stack.
WANT = {
    "compute": (Role.COMPUTE, None),
    "tp_wait": (Role.COLLECTIVE, "tp"),
    "dp_wait": (Role.COLLECTIVE, "dp"),
    "recv_bwd": (Role.P2P, "next"),
    "recv_fwd": (Role.P2P, "prev"),
}


def stack_library() -> dict[str, dict[str, tuple[int, str]]]:
    """For each wanted class and format: (pid, text) of one real captured dump showing it."""
    reader, parser = StackReader(), DumpParser()
    lib: dict[str, dict[str, tuple[int, str]]] = {}
    for case in sorted(p for p in FIXTURES.iterdir() if p.is_dir() and "hang" in p.name):
        for f in sorted(case.glob("rank*_pid*.*")):
            dn = DumpName.parse(f.name)
            if dn is None:
                continue
            text = f.read_text()
            (proc,) = parser.parse(text, dn.fmt, f.name, dn.pid)
            thread = proc.main_thread()
            assert thread is not None
            if dn.worker is not None:
                child = reader.read_child(dn.pid, thread.frames)
                key = "worker_idle" if child.process.value == "dataloader" and not child.busy else None
            else:
                info = reader.read(thread.frames)
                key = next(
                    (k for k, (role, x) in WANT.items() if (info.role, info.peer or info.kind) == (role, x)),
                    None,
                )
            if key is not None:
                lib.setdefault(key, {}).setdefault(dn.fmt, (dn.pid, text))
    missing = [k for k in [*WANT, "worker_idle"] for fmt in ("txt", "json") if fmt not in lib.get(k, {})]
    if missing:
        raise SystemExit(
            f"fixtures lack stack classes {sorted(set(missing))}: run scripts/capture_stack_fixtures.py"
        )
    return lib


def role_of(rank: int) -> str:
    c, root = TOPO.coords(rank), TOPO.coords(ROOT_RANK)
    if c.dp != root.dp:
        return "dp_wait"
    if c.pp == root.pp:
        return "compute" if c.tp == root.tp else "tp_wait"
    return "recv_bwd" if c.pp < root.pp else "recv_fwd"


def build_entries(
    lib: dict[str, dict[str, tuple[int, str]]], fmt: str, workers: bool = True
) -> list[tuple[str, str]]:
    """(file name, text) of every rank's main dump (and worker dump), each with its own pid."""
    entries = []
    for rank in range(TOPO.world_size):
        procs = [(f"rank{rank}_pid{{pid}}", role_of(rank))]
        if workers:
            procs.append((f"rank{rank}_worker0_pid{{pid}}", "worker_idle"))
        for name, key in procs:
            pid = 100_000 + 2 * rank + (key == "worker_idle")
            src_pid, text = lib[key][fmt]
            entries.append((f"{name.format(pid=pid)}.{fmt}", text.replace(str(src_pid), str(pid))))
    return entries


def timed(fn: Callable[[], T], repeat: int) -> tuple[list[float], T]:
    times = []
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def _parse(entries: list[tuple[str, str]], fmt: str) -> Round:
    return collect_round(entries, DumpParser(), prefer=fmt)


def _classify(round_: Round) -> OverEvictionResult:
    return OverEvictionClassifier(TOPO).analyze([round_])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=1.0, help="parse + classify budget per format")
    ap.add_argument("--check", action="store_true", help="exit 1 when over budget")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core, as the budget says
    lib = stack_library()
    print(f"topology tp{TOPO.tp} pp{TOPO.pp} dp{TOPO.dp}: {TOPO.world_size} ranks, root rank {ROOT_RANK}")
    over = False
    for fmt, workers in (("txt", True), ("json", True), ("txt", False), ("json", False)):
        entries = build_entries(lib, fmt, workers)
        size_mb = sum(len(t) for _, t in entries) / 1e6
        parse_t, round_ = timed(functools.partial(_parse, entries, fmt), args.repeat)
        classify_t, result = timed(functools.partial(_classify, round_), args.repeat)
        ok = result.verdict == Verdict.HANG and ROOT_RANK in result.evict_ranks
        total = min(parse_t) + min(classify_t)
        over |= total > args.budget_s or not ok
        what = "main+worker" if workers else "main only"
        print(
            f"{fmt:>4} {what:<11}: {len(entries)} dumps ({size_mb:.1f} MB)  "
            f"parse best {min(parse_t) * 1e3:.0f} ms (median {statistics.median(parse_t) * 1e3:.0f})  "
            f"classify best {min(classify_t) * 1e3:.0f} ms "
            f"(median {statistics.median(classify_t) * 1e3:.0f})  "
            f"total {total * 1e3:.0f} ms  {'ok' if ok else 'WRONG'}"
        )
    print(
        f"verdict {result.verdict.value}: evict {result.evict_kind} group of {len(result.evict_ranks)} ranks "
        f"on machines {list(result.evict_machines)}"
    )
    print(f"budget {args.budget_s:.2f} s per run: {'exceeded by at least one run' if over else 'met'}")
    return 1 if over and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
