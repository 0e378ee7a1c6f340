"""Benchmark: how fast the demo job's hangs are found, per kind, against the collective timeout.

    .venv/bin/python bench/hang_detection.py --runs 3 [--out-dir DIR] [--summaries DIR/run*.json]

Runs the real demo job (`trainguard demo --no-baseline`, the stack already up) ``--runs`` times on
a scenario of one hang of each kind -- in compute (``hang``), in the DataLoader worker
(``hang-dataloader``), in the checkpoint writer (``hang-checkpoint``) and in a pipeline send
(``hang-p2p``: the rank's sends are lost, both neighbours block in ``recv``) -- and of a whole
machine frozen (``machine-freeze``: its exporter and ranks stopped, nothing comes from it) --
and prints, per kind, the median and the worst over the runs of:

* ``detect``: injection -> the first detection of the stall (the hang suspicion that starts the
  stack capture, or the hang itself);
* ``localise``: injection -> the decision naming the machines to evict (the capture's verdict);
* ``recovered``: injection -> training steps again;
* ``decided by``: what the eviction carried out came from, in each run (the detection's kind;
  for a stack capture's verdict, which witnesses decided it: the stacks, the Flight Recorder,
  both, or the group holding both's suspects);

next to the stall threshold the demo derives from its step time and the job's collective
(gloo) timeout, which is what would find the hang without TrainGuard.  The injection is when the
fault is armed; it fires at the rank's next step, so ``detect`` includes up to one step.
``--summaries`` re-reads earlier runs' summary files instead of running the demo.  While the
demo runs, stderr shows which run is on, its time so far and the ETA (``TRAINGUARD_PROGRESS=0``:
nothing); stdout is unchanged.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trainguard.infra.config import load_settings
from trainguard.infra.progress import Progress

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = [
    {"fault": "hang", "machine": 3},
    {"fault": "hang-dataloader", "machine": 2},
    {"fault": "hang-checkpoint", "machine": 1},
    {"fault": "hang-p2p", "machine": 0},
    {"fault": "machine-freeze", "machine": 2},
]
COLUMNS = (("detect", "detected_s"), ("localise", "localised_s"), ("recovered", "recovered_s"))


def run_demo(out_dir: Path, n: int, bar: Progress) -> Path:
    scenario = out_dir / "hang-scenario.yaml"
    scenario.write_text("".join(f"- {{fault: {s['fault']}, machine: {s['machine']}}}\n" for s in SCENARIO))
    summary = out_dir / f"run{n}-summary.json"
    log = out_dir / f"run{n}.log"
    bar.update(detail=f"run {n}: `trainguard demo` (log {log})")
    started = time.monotonic()
    with log.open("wb") as f:
        rc = subprocess.call(
            [sys.executable, "-m", "trainguard", "demo", "--scenario", str(scenario), "--no-baseline",
             "--summary-json", str(summary)],
            cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
        )  # fmt: skip
    bar.advance()
    bar.echo(f"run {n}: exit {rc} in {time.monotonic() - started:.0f} s ({log})")
    if rc != 0 or not summary.exists():
        bar.echo(log.read_text()[-3000:])
        raise SystemExit(1)
    return summary


def table(summaries: list[dict[str, Any]], pg_timeout_s: float, threshold: str) -> str:
    values: dict[str, dict[str, list[float]]] = {}
    for s in summaries:
        for inc in s.get("incidents", []):
            cols = values.setdefault(str(inc["fault"]), {})
            for name, key in COLUMNS:
                if inc.get(key) is not None:
                    cols.setdefault(name, []).append(float(inc[key]))
    lines = [
        f"{len(summaries)} run(s); seconds, median (worst); stall threshold {threshold}; "
        f"collective timeout {pg_timeout_s:.0f} s",
        "| hang in | detect | localise | recovered | worst detect / collective timeout | decided by |",
        "|---|---:|---:|---:|---:|---|",
    ]
    by: dict[str, list[str]] = {}
    for s in summaries:
        for inc in s.get("incidents", []):
            by.setdefault(str(inc["fault"]), []).append(str(inc.get("decided_by") or "-"))
    for fault, cols in values.items():
        cells = [
            f"{statistics.median(cols[name]):.1f} ({max(cols[name]):.1f})" if cols.get(name) else "-"
            for name, _ in COLUMNS
        ]
        worst = max(cols.get("detect", [float("nan")]))
        lines.append(
            f"| {fault} | " + " | ".join(cells) + f" | {worst / pg_timeout_s:.1%} | {'; '.join(by[fault])} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out-dir", type=Path, default=load_settings().stack.home_path / "bench-hangs")
    ap.add_argument("--summaries", nargs="*", type=Path, help="read these summaries instead of running")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "demo"))
    from trainguard_demo.run import DemoConfig  # the demo's own settings, not the product's

    cfg = DemoConfig()
    if args.summaries:
        paths = list(args.summaries)
    else:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        bar = Progress("hang bench", total=args.runs, unit="runs")
        with bar, bar.ticking():
            paths = [run_demo(args.out_dir, n, bar) for n in range(1, args.runs + 1)]
    summaries = [json.loads(p.read_text()) for p in paths]
    threshold = f"{cfg.stall_factor:g} x p99 step time within [{cfg.min_stall_s:g}, {cfg.stall_s:g}] s"
    print(table(summaries, float(cfg.pg_timeout_s), threshold))
    return 0


if __name__ == "__main__":
    sys.exit(main())
