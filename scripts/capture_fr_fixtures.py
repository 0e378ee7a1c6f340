"""Record real Flight Recorder dumps from small gloo jobs with injected faults.

For each scenario this launches ``scripts/fixture_job.py`` as ``tp*pp*dp`` processes on CPU
(gloo) with the Flight Recorder on (``--fr-dir``), waits until the fault has taken hold (no rank's
step counter moved for ``--stuck-s``; a healthy job: a few steps), asks every rank to dump, and
copies what the ranks wrote into ``OUT/<scenario>/pickle/fr_trace_rank_<R>`` (PyTorch's pickle)
and ``OUT/<scenario>/json/fr_trace_rank_<R>`` (its JSON), plus ``manifest.json`` (topology, fault,
faulty rank, the ranks that could not dump, the expected verdict).  A dead or stopped rank writes
no dump: that is part of the fixture.

Usage: ``python scripts/capture_fr_fixtures.py --out tests/fixtures/flight_recorder [--only NAME]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture_stack_fixtures import JOB, ROOT, free_port, wait_steps, wait_stuck


@dataclass(frozen=True)
class Scenario:
    name: str
    tp: int
    pp: int
    dp: int
    fault: (
        str  # none | compute_hang | skip_send | skip_allreduce | mismatch_allreduce | die | stop_in_allreduce
    )
    fault_rank: int = -1
    expected_verdict: str = "hang"
    expected_kind: str | None = "pp"
    # The rank the analysis should name when it is not the faulty one: gloo records no
    # point-to-point operations, so a rank blocked in a recv looks as if it waited for nothing.
    expected_suspect: int | None = None
    also: tuple[int, ...] = ()  # more faulty ranks, same fault, same step
    ep: int = 1  # expert-parallel group size (1: none)


# rank = tp + TP*dp + TP*DP*pp (Megatron's tp-dp-pp order); two ranks per machine.  No mismatch
# scenario: on gloo a mismatched all-reduce size (fixture_job's mismatch_allreduce) killed the
# peer rank, which then wrote no dump, so the dumps show a dead rank, not the mismatch.
SCENARIOS = [
    Scenario("tp2pp2dp2_healthy", 2, 2, 2, "none", expected_verdict="healthy", expected_kind=None),
    Scenario("tp2pp2dp2_compute_hang", 2, 2, 2, "compute_hang", 5),
    Scenario("tp2pp2dp2_skip_send", 2, 2, 2, "skip_send", 1, expected_suspect=5),
    Scenario("tp2pp2dp2_skip_allreduce", 2, 2, 2, "skip_allreduce", 6),
    Scenario("tp2pp2dp2_die", 2, 2, 2, "die", 2),
    Scenario("tp2pp2dp2_stop_in_allreduce", 2, 2, 2, "stop_in_allreduce", 4),
    Scenario("tp2pp2dp4_healthy", 2, 2, 4, "none", expected_verdict="healthy", expected_kind=None),
    Scenario("tp2pp2dp4_compute_hang", 2, 2, 4, "compute_hang", 13),
    Scenario("tp2pp2dp4_skip_allreduce", 2, 2, 4, "skip_allreduce", 3),
    Scenario("tp2pp2dp4_die", 2, 2, 4, "die", 10),
    Scenario("tp2pp2dp4_stop_in_allreduce", 2, 2, 4, "stop_in_allreduce", 7),
]

# Issue #41: Megatron-like groups the tp/pp/dp arithmetic alone does not cover -- TP groups of 4,
# expert-parallel groups carved out of DP -- and several faulty ranks at once
# (``--set megatron``, written to ``tests/fixtures/flight_recorder_megatron``).
MEGATRON = [
    Scenario("tp4pp2_healthy", 4, 2, 1, "none", expected_verdict="healthy", expected_kind=None),
    Scenario("tp4pp2_compute_hang", 4, 2, 1, "compute_hang", 6),
    Scenario("tp4pp2_two_compute_hangs", 4, 2, 1, "compute_hang", 1, also=(6,)),
    Scenario("tp2dp4ep2_healthy", 2, 1, 4, "none", expected_verdict="healthy", expected_kind=None, ep=2),
    # PP 1: no pipeline to evict, the TP group goes.
    Scenario("tp2dp4ep2_two_compute_hangs", 2, 1, 4, "compute_hang", 2, expected_kind="tp", also=(5,), ep=2),
    Scenario("tp2dp4ep2_die", 2, 1, 4, "die", 6, expected_kind="tp", ep=2),
]


def wait_dumps(fr: Path, world: int, timeout_s: float) -> list[int]:
    """Ranks whose pickle and JSON dumps both appeared within ``timeout_s`` (dead ranks never do)."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = [
            r
            for r in range(world)
            if (fr / "pickle" / f"fr_trace_rank_{r}").exists()
            and (fr / "json" / f"fr_trace_rank_{r}").exists()
        ]
        if len(done) == world or time.monotonic() > deadline:
            return done
        time.sleep(0.2)


def capture(sc: Scenario, out_root: Path, stuck_s: float, fault_step: int, entries: int) -> dict[str, object]:
    world = sc.tp * sc.pp * sc.dp
    out = out_root / sc.name
    if out.exists():
        shutil.rmtree(out)
    work = Path(tempfile.mkdtemp(prefix=f"tg_fr_{sc.name}_"))
    os.mkfifo(work / "data.fifo")
    os.mkfifo(work / "ckpt.fifo")
    fr = work / "fr"
    fr.mkdir()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(JOB), "--tp", str(sc.tp), "--pp", str(sc.pp), "--dp", str(sc.dp)]
    cmd += ["--fault", sc.fault, "--fault-rank", str(sc.fault_rank), "--fault-step", str(fault_step)]
    cmd += [arg for r in sc.also for arg in ("--also-fault-rank", str(r))] + ["--ep", str(sc.ep)]
    cmd += ["--workdir", str(work), "--fr-dir", str(fr), "--fr-entries", str(entries)]
    procs: dict[int, subprocess.Popen[bytes]] = {}
    dumped: list[int] = []
    dumped_at: dict[str, dict[str, int]] = {}
    try:
        for r in range(world):
            log = open(work / f"rank{r}.log", "wb")  # noqa: SIM115 -- closed with the process
            procs[r] = subprocess.Popen(
                cmd, env=dict(env, RANK=str(r)), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        if sc.fault == "none":
            wait_steps(work, world, fault_step + 3, timeout_s=180)
        else:
            wait_stuck(work, world, stuck_s, timeout_s=180)
        (fr / "dump-now").touch()
        dumped = wait_dumps(fr, world, timeout_s=30)
        out.mkdir(parents=True)
        for fmt in ("pickle", "json"):
            shutil.copytree(fr / fmt, out / fmt, ignore=shutil.ignore_patterns(".*"))
            # When each dump was written: a checkout does not keep file times, the analysis needs them.
            files = [f for f in sorted((fr / fmt).iterdir()) if not f.name.startswith(".")]
            dumped_at[fmt] = {f.name.rsplit("_", 1)[1]: f.stat().st_mtime_ns for f in files}
    finally:
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        shutil.rmtree(work, ignore_errors=True)
    manifest: dict[str, object] = {
        "name": sc.name,
        "topology": {"tp": sc.tp, "pp": sc.pp, "dp": sc.dp, "ranks_per_machine": 2, "order": "tp-dp-pp"},
        "fault": sc.fault,
        "faulty_rank": sc.fault_rank if sc.fault != "none" else None,
        **({"faulty_ranks": [sc.fault_rank, *sc.also]} if sc.also else {}),
        **({"ep": sc.ep} if sc.ep > 1 else {}),
        "fault_step": fault_step,
        "not_dumped": sorted(set(range(world)) - set(dumped)),
        "dumped_at_ns": dumped_at,
        "buffer_entries": entries,
        "expected": {
            "verdict": sc.expected_verdict,
            "kind": sc.expected_kind,
            "suspect": sc.fault_rank if sc.expected_suspect is None else sc.expected_suspect,
        },
        "recorded_with": {"torch": _torch_version(), "backend": "gloo", "job": "scripts/fixture_job.py"},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _torch_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("torch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="default: tests/fixtures/flight_recorder[_megatron]")
    ap.add_argument("--set", choices=("basic", "megatron"), default="basic", help="which scenarios")
    ap.add_argument("--only", action="append", help="scenario name (repeatable); default: all")
    # Longer than the analysis' min_stuck_s (3 s): a dump must show the wait for what it is.
    ap.add_argument("--stuck-s", type=float, default=6.0)
    ap.add_argument("--fault-step", type=int, default=3)
    ap.add_argument("--entries", type=int, default=200, help="Flight Recorder buffer (ring) size per rank")
    args = ap.parse_args()
    scenarios = MEGATRON if args.set == "megatron" else SCENARIOS
    suffix = "_megatron" if args.set == "megatron" else ""
    args.out = args.out or ROOT / "tests" / "fixtures" / f"flight_recorder{suffix}"
    chosen = [s for s in scenarios if not args.only or s.name in args.only]
    unknown = set(args.only or []) - {s.name for s in chosen}
    if unknown:
        ap.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    for sc in chosen:
        t0 = time.monotonic()
        m = capture(sc, args.out, args.stuck_s, args.fault_step, args.entries)
        print(
            f"{sc.name}: recorded in {time.monotonic() - t0:.1f}s, not dumped: {m['not_dumped']}", flush=True
        )


if __name__ == "__main__":
    main()
