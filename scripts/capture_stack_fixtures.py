"""Capture real py-spy stack fixtures from small gloo jobs with injected faults.

For each scenario this launches ``scripts/fixture_job.py`` as ``tp*pp*dp`` (<= 16) processes on
CPU (``MASTER_ADDR=127.0.0.1``, gloo), waits until the fault has taken hold, dumps every rank
process and its children with ``py-spy dump --pid P`` (text) and ``py-spy dump --pid P --json``
into ``OUT/<scenario>/`` (``rank<R>_pid<P>.txt|.json``, ``rank<R>_worker<K>_pid<P>.txt|.json``),
writes ``manifest.json`` (topology, fault, faulty rank, expected verdict and group kind), and
kills the job.

Hang scenarios are captured as one round once no rank has advanced for ``--stuck-s`` seconds.
Fail-slow and healthy scenarios are captured as several rounds ``round<N>/``, ``--interval-s``
apart (2.5 s here to keep captures short; production samples every 10 s, ByteRobust §5).

Usage: ``python scripts/capture_stack_fixtures.py --out tests/fixtures/stacks [--only NAME]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "scripts" / "fixture_job.py"
PY_SPY = Path(sys.executable).parent / "py-spy"
PRODUCTION_INTERVAL_S = 10.0


@dataclass(frozen=True)
class Scenario:
    name: str
    tp: int
    pp: int
    dp: int
    ranks_per_machine: int
    fault: str  # none | compute_hang | dataloader_hang | checkpoint_hang | skip_send | slow_rank
    fault_rank: int = -1
    checkpoint: bool = False
    rounds: int = 1
    # Per-step forward compute of every rank: multi-round captures need ranks that spend real
    # time computing, or every sample would catch them waiting at the same spot.
    compute_s: float = 0.0
    # slow_rank: how many times longer the straggler's compute takes.
    slow_factor: float = 5.0
    # What the analysis should say; the group kind is ByteRobust's unit: the root's pipeline.
    expected_verdict: str = "hang"
    expected_kind: str | None = "pp"
    # py-spy's formats to keep; the long multi-round captures keep text only (a fifth the size).
    formats: tuple[str, ...] = ("txt", "json")


def long_capture(name: str, tp: int, pp: int, dp: int, fault: str, rank: int, rounds: int) -> Scenario:
    """A multi-round capture for the fail-slow significance tests and bench (text dumps only):
    a healthy job (``fault="none"``, with checkpoints) or a slow rank, every rank computing."""
    healthy = fault == "none"
    return Scenario(
        name, tp, pp, dp, 2, fault, rank, checkpoint=healthy, rounds=rounds, compute_s=0.15,
        expected_verdict="healthy" if healthy else "fail_slow", expected_kind=None if healthy else "pp",
        formats=("txt",),
    )  # fmt: skip


SCENARIOS = [
    # tp2-pp2-dp2: rank = tp + 2*dp + 4*pp; rank 5 = (tp1, dp0, last stage).
    Scenario("tp2pp2dp2_compute_hang_last_stage", 2, 2, 2, 2, "compute_hang", 5),
    Scenario("tp2pp2dp2_dataloader_hang_first_stage", 2, 2, 2, 2, "dataloader_hang", 2),
    Scenario("tp2pp2dp2_checkpoint_hang_last_stage", 2, 2, 2, 2, "checkpoint_hang", 7, checkpoint=True),
    Scenario("tp2pp2dp2_skip_send_first_stage", 2, 2, 2, 2, "skip_send", 1),
    # tp1-pp4-dp2: rank = dp + 2*pp; rank 3 = (dp1, stage 1), rank 4 = (dp0, stage 2).
    Scenario("tp1pp4dp2_compute_hang_middle_stage", 1, 4, 2, 2, "compute_hang", 3),
    Scenario("tp1pp4dp2_dataloader_hang_middle_stage", 1, 4, 2, 2, "dataloader_hang", 4),
    Scenario("tp1pp4dp2_skip_send_middle_stage", 1, 4, 2, 2, "skip_send", 4),
    # tp2-pp4-dp1: rank = tp + 2*pp; rank 0 first stage, rank 6 last stage.
    Scenario("tp2pp4dp1_compute_hang_first_stage", 2, 4, 1, 2, "compute_hang", 0),
    Scenario("tp2pp4dp1_checkpoint_hang_middle_stage", 2, 4, 1, 2, "checkpoint_hang", 3, checkpoint=True),
    Scenario("tp2pp4dp1_dataloader_hang_last_stage", 2, 4, 1, 2, "dataloader_hang", 6),
    # tp2-pp1-dp4: no pipeline, so the TP group (one machine here) is the unit to evict.
    Scenario("tp2pp1dp4_compute_hang", 2, 1, 4, 2, "compute_hang", 5, expected_kind="tp"),
    Scenario(
        "tp2pp2dp2_slow_rank_middle",
        2,
        2,
        2,
        2,
        "slow_rank",
        6,
        rounds=5,
        compute_s=0.15,
        expected_verdict="fail_slow",
    ),
    Scenario(
        "tp1pp4dp2_slow_rank_last_stage",
        1,
        4,
        2,
        2,
        "slow_rank",
        7,
        rounds=5,
        compute_s=0.15,
        expected_verdict="fail_slow",
    ),
    Scenario(
        "tp2pp2dp2_healthy",
        2,
        2,
        2,
        2,
        "none",
        checkpoint=True,
        rounds=5,
        compute_s=0.15,
        expected_verdict="healthy",
        expected_kind=None,
    ),
    # Long captures: healthy jobs at 8 and 16 ranks (a false eviction is a vote won by chance),
    # and slow ranks, so that a bench can slide 5..15-round windows over them.
    long_capture("tp2pp2dp2_healthy_r15", 2, 2, 2, "none", -1, 15),
    long_capture("tp1pp4dp2_healthy_r15", 1, 4, 2, "none", -1, 15),
    long_capture("tp2pp2dp4_healthy_r15", 2, 2, 4, "none", -1, 15),
    long_capture("tp2pp4dp2_healthy_r15", 2, 4, 2, "none", -1, 15),
    long_capture("tp1pp4dp2_slow_rank_r15", 1, 4, 2, "slow_rank", 5, 15),
    long_capture("tp2pp2dp4_slow_rank_r15", 2, 2, 4, "slow_rank", 11, 15),
    long_capture("tp1pp4dp4_slow_rank_r15", 1, 4, 4, "slow_rank", 9, 15),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children(pid: int) -> list[int]:
    """Direct child pids (dataloader workers, checkpoint writer), from /proc."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(set(out))


def is_python(pid: int) -> bool:
    try:
        return "python" in Path(f"/proc/{pid}/exe").resolve().name
    except OSError:
        return False


def dump_round(procs: dict[int, subprocess.Popen[bytes]], out: Path, formats: tuple[str, ...]) -> None:
    """Dump every rank and its children, all processes at once per format.

    The On-Demand Tracer runs on every machine in parallel; dumping one process after the
    other would spread a round over seconds, and a job that still moves (fail-slow, healthy)
    would then show ranks from different steps side by side.
    """
    out.mkdir(parents=True, exist_ok=True)
    stems: list[tuple[int, Path]] = []
    for rank, proc in procs.items():
        stems.append((proc.pid, out / f"rank{rank}_pid{proc.pid}"))
        kids = [c for c in children(proc.pid) if is_python(c)]
        stems += [(c, out / f"rank{rank}_worker{k}_pid{c}") for k, c in enumerate(kids)]
    chosen = [(s, e) for s, e in ((".txt", []), (".json", ["--json"])) if s[1:] in formats]
    for suffix, extra in chosen:
        spies = [
            (
                pid,
                stem,
                subprocess.Popen(
                    [str(PY_SPY), "dump", "--pid", str(pid), *extra],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                ),
            )
            for pid, stem in stems
        ]
        for pid, stem, spy in spies:
            stdout, stderr = spy.communicate(timeout=60)
            if spy.returncode != 0:
                raise RuntimeError(f"py-spy dump of {pid} failed: {stderr.decode().strip()}")
            stem.with_suffix(suffix).write_bytes(stdout)


def steps(work: Path, world: int) -> list[int]:
    out = []
    for r in range(world):
        try:
            out.append(int((work / f"step_rank{r}").read_text() or -1))
        except (OSError, ValueError):
            out.append(-1)
    return out


def wait_stuck(work: Path, world: int, stuck_s: float, timeout_s: float) -> list[int]:
    """Wait until every rank has started and no rank's step counter moved for ``stuck_s``."""
    deadline = time.monotonic() + timeout_s
    last, since = steps(work, world), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = steps(work, world)
        if now != last:
            last, since = now, time.monotonic()
        elif min(now) >= 0 and time.monotonic() - since >= stuck_s:
            return now
    raise TimeoutError(f"job did not get stuck within {timeout_s}s (steps {last})")


def wait_steps(work: Path, world: int, at_least: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while min(steps(work, world)) < at_least:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job did not reach step {at_least} (steps {steps(work, world)})")
        time.sleep(0.2)


def capture(sc: Scenario, out_root: Path, interval_s: float, stuck_s: float, fault_step: int) -> None:
    world = sc.tp * sc.pp * sc.dp
    out = out_root / sc.name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    work = Path(tempfile.mkdtemp(prefix=f"tg_{sc.name}_"))
    os.mkfifo(work / "data.fifo")
    os.mkfifo(work / "ckpt.fifo")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(JOB), "--tp", str(sc.tp), "--pp", str(sc.pp), "--dp", str(sc.dp)]
    cmd += ["--fault", sc.fault, "--fault-rank", str(sc.fault_rank), "--fault-step", str(fault_step)]
    cmd += ["--workdir", str(work), "--compute-s", str(sc.compute_s), "--slow-factor", str(sc.slow_factor)]
    cmd += ["--checkpoint"] if sc.checkpoint else []
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for r in range(world):
            log = open(work / f"rank{r}.log", "wb")  # noqa: SIM115 -- closed with the process
            procs[r] = subprocess.Popen(
                cmd, env=dict(env, RANK=str(r)), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        if sc.rounds == 1:
            wait_stuck(work, world, stuck_s, timeout_s=120)
            dump_round(procs, out, sc.formats)
        else:
            wait_steps(work, world, fault_step + 1, timeout_s=120)
            for n in range(sc.rounds):
                dump_round(procs, out / f"round{n}", sc.formats)
                time.sleep(interval_s)
        for r, p in procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"rank {r} exited early: {(work / f'rank{r}.log').read_text()[-2000:]}")
    finally:
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # the rank and its dataloader/checkpoint children
            p.wait()
        shutil.rmtree(work, ignore_errors=True)
    manifest = {
        "name": sc.name,
        "topology": {
            "tp": sc.tp,
            "pp": sc.pp,
            "dp": sc.dp,
            "ranks_per_machine": sc.ranks_per_machine,
            "order": "tp-dp-pp",
        },
        "fault": sc.fault,
        "faulty_rank": sc.fault_rank if sc.fault != "none" else None,
        "fault_step": fault_step,
        "compute_s": sc.compute_s,
        "slow_factor": sc.slow_factor if sc.fault == "slow_rank" else None,
        "rounds": sc.rounds,
        "interval_s": interval_s if sc.rounds > 1 else None,
        "production_interval_s": PRODUCTION_INTERVAL_S,
        "expected": {"verdict": sc.expected_verdict, "kind": sc.expected_kind},
        "captured_with": {"py_spy": "0.4.3", "backend": "gloo", "job": "scripts/fixture_job.py"},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "stacks")
    ap.add_argument("--only", action="append", help="scenario name (repeatable); default: all")
    ap.add_argument("--interval-s", type=float, default=2.5)
    ap.add_argument("--stuck-s", type=float, default=3.0)
    ap.add_argument("--fault-step", type=int, default=3)
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    if args.list:
        print("\n".join(s.name for s in SCENARIOS))
        return
    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only]
    unknown = set(args.only or []) - {s.name for s in chosen}
    if unknown:
        ap.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    for sc in chosen:
        t0 = time.monotonic()
        capture(sc, args.out, args.interval_s, args.stuck_s, args.fault_step)
        print(f"{sc.name}: captured in {time.monotonic() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
