"""Run the end-to-end demo several times back to back and print one line of numbers per run.

    .venv/bin/python bench/demo_runs.py --runs 3 [--out-dir DIR] [-- extra `trainguard demo` args]

Each run is the real main job (`trainguard demo --summary-json FILE`, the stack already up), timed
from the outside.  Per run: wall time, incidents recovered / injected, TrainGuard's ETTR and the
baseline's (same ClickHouse query, same run), the lowest 1-hour sliding ETTR, and p50 / p90 of the
detect and recover seconds over the run's incidents.  A run that exits non-zero or writes no
summary is reported as failed with the tail of its output.  Exit status: 0 when every run wrote a
summary with every incident recovered and a measured ETTR (an ETTR of 0 over 0 s means ClickHouse
holds no training steps of the job: the pipeline lost them), 1 otherwise.  While it runs, stderr
shows which run is on, its time so far and the ETA (``TRAINGUARD_PROGRESS=0``: nothing); stdout
holds only the per-run lines.
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


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def describe(summary: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """One run's numbers from its summary JSON."""
    incidents = summary.get("incidents", [])
    detected = [float(i["detected_s"]) for i in incidents if i.get("detected_s") is not None]
    recovered = [float(i["recovered_s"]) for i in incidents if i.get("recovered_s") is not None]
    return {
        "wall_s": round(wall_s, 1),
        "recovered": sum(1 for i in incidents if i.get("recovered")),
        "injected": len(incidents),
        "ettr": summary.get("ettr"),
        "baseline_ettr": summary.get("baseline_ettr"),
        "sliding_ettr_min": summary.get("sliding_ettr_min"),
        "detect_p50_s": percentile(detected, 0.5),
        "detect_p90_s": percentile(detected, 0.9),
        "recover_p50_s": percentile(recovered, 0.5),
        "recover_p90_s": percentile(recovered, 0.9),
        "not_recovered": [i["fault"] for i in incidents if not i.get("recovered")],
    }


def _fmt(value: Any, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _run(run: int, out_dir: Path, exe: Path, demo_args: list[str], bar: Progress) -> dict[str, Any] | None:
    """One demo run, its line printed; None when it wrote no summary."""
    summary_path = out_dir / f"run{run}-summary.json"
    log_path = out_dir / f"run{run}.log"
    summary_path.unlink(missing_ok=True)
    bar.update(detail=f"run {run}: `trainguard demo` (log {log_path})")
    started = time.monotonic()
    with open(log_path, "wb") as log:
        code = subprocess.call(
            [str(exe), "demo", "--summary-json", str(summary_path), *demo_args],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    wall_s = time.monotonic() - started
    bar.advance()
    if not summary_path.exists():
        tail = log_path.read_text(errors="replace")[-2000:]
        bar.echo(f"run {run}: FAILED (exit {code}, {wall_s:.0f} s, no summary); log tail:\n{tail}")
        return None
    row = describe(json.loads(summary_path.read_text()), wall_s)
    row["exit"] = code
    bar.echo(
        f"run {run}: {row['wall_s'] / 60:.1f} min  recovered {row['recovered']}/{row['injected']}  "
        f"ETTR {_fmt(row['ettr'], '{:.1%}')}  baseline {_fmt(row['baseline_ettr'], '{:.1%}')}  "
        f"lowest sliding {_fmt(row['sliding_ettr_min'], '{:.1%}')}  "
        f"detect p50/p90 {_fmt(row['detect_p50_s'], '{:.1f}')}/{_fmt(row['detect_p90_s'], '{:.1f}')} s  "
        f"recover p50/p90 {_fmt(row['recover_p50_s'], '{:.1f}')}/{_fmt(row['recover_p90_s'], '{:.1f}')} s"
        + (f"  NOT recovered: {', '.join(row['not_recovered'])}" if row["not_recovered"] else "")
        + (f"  (exit {code})" if code else "")
    )
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=load_settings().stack.home_path / "demo-runs")
    parser.add_argument("demo_args", nargs="*", help="extra arguments for `trainguard demo` (after --)")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    exe = Path(sys.executable).with_name("trainguard")
    results: list[dict[str, Any] | None] = []
    bar = Progress("demo runs", total=args.runs, unit="runs")
    with bar, bar.ticking():
        for run in range(1, args.runs + 1):
            results.append(_run(run, args.out_dir, exe, args.demo_args, bar))
    (args.out_dir / "runs.json").write_text(json.dumps(results, indent=2))
    ok = all(
        r is not None and r["recovered"] == r["injected"] and r["exit"] == 0 and r["ettr"] for r in results
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
