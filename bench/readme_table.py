"""A bench's markdown table for bench/README.md, from the JSON the bench wrote.

    python bench/readme_table.py demo_runs DIR/runs.json       # bench/demo_runs.py's runs.json
    python bench/readme_table.py chaos chaos.json              # bench/chaos.py --json
    python bench/readme_table.py stream_load load.json         # bench/stream_load.py --json
    python bench/readme_table.py --rows-only demo_runs runs.json

Prints the table's header and one row per run (or scenario, or load level), formatted as the
tables of bench/README.md are, so a new run's figures are pasted, not typed.  "-" stands for a
figure the run did not measure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Table = tuple[list[str], list[list[str]]]


def _num(value: Any, pattern: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return pattern.format(value)


def _pair(a: Any, b: Any, pattern: str = "{:.1f}", unit: str = " s") -> str:
    if a is None and b is None:
        return "-"
    return f"{_num(a, pattern)} / {_num(b, pattern)}{unit}"


def demo_runs(data: Any) -> Table:
    """``runs.json`` of ``bench/demo_runs.py``: a list with one object per run, ``null`` for a run
    that wrote no summary.

    >>> head, rows = demo_runs([{"wall_s": 768.0, "recovered": 11, "injected": 12, "ettr": 0.934,
    ...     "baseline_ettr": 0.312, "sliding_ettr_min": 0.86, "detect_p50_s": 0.6, "detect_p90_s": 2.1,
    ...     "recover_p50_s": 8.1, "recover_p90_s": 15.0}, None])
    >>> rows[0]
    ['1', '12.8 min', '11/12', '93.4%', '31.2%', '86.0%', '0.6 / 2.1 s', '8.1 / 15.0 s']
    >>> rows[1][:3]
    ['2', 'failed', '-']
    """
    head = ["run", "wall", "recovered", "ETTR", "baseline ETTR", "lowest 1-h sliding",
            "detect p50 / p90", "recover p50 / p90"]  # fmt: skip
    rows = []
    for i, r in enumerate(data, 1):
        if r is None:
            rows.append([str(i), "failed"] + ["-"] * (len(head) - 2))
            continue
        rows.append(
            [
                str(i),
                _num(r.get("wall_s") and r["wall_s"] / 60, "{:.1f} min"),
                f"{r.get('recovered', 0)}/{r.get('injected', 0)}",
                _num(r.get("ettr"), "{:.1%}"),
                _num(r.get("baseline_ettr"), "{:.1%}"),
                _num(r.get("sliding_ettr_min"), "{:.1%}"),
                _pair(r.get("detect_p50_s"), r.get("detect_p90_s")),
                _pair(r.get("recover_p50_s"), r.get("recover_p90_s")),
            ]
        )
    return head, rows


def chaos(data: Any) -> Table:
    """``bench/chaos.py --json``: ``{"scenarios": [{"name", "passed", "produced", ...}, ...]}``."""
    head = ["scenario", "passed", "produced", "lost", "duplicated", "forged accepted",
            "decisions expected / made / acted"]  # fmt: skip
    rows = []
    for s in data["scenarios"]:
        decisions = [s.get(k) for k in ("decisions_expected", "decisions_made", "decisions_acted")]
        rows.append(
            [
                s["name"],
                "yes" if s.get("passed") else "NO",
                _num(s.get("produced"), "{:,}"),
                _num(s.get("lost"), "{}"),
                _num(s.get("duplicated"), "{}"),
                _num(s.get("accepted_forged"), "{}"),
                "-" if all(d is None for d in decisions) else " / ".join(_num(d, "{}") for d in decisions),
            ]
        )
    return head, rows


def stream_load(data: Any) -> Table:
    """``bench/stream_load.py --json``: one row per load level (machines, workers)."""
    head = ["machines", "workers", "input msg/s", "keeps up", "Xid->decision p50 / p99",
            "worker CPU ms / 1k msgs (/ 1k processed)", "worker core used", "sink CPU ms / 1k"]  # fmt: skip
    sink_process = bool(data.get("sink_process"))
    rows = []
    for lv in data["levels"]:
        processed = _num(lv.get("worker_cpu_ms_per_1k_processed"), "{:.0f}")
        rows.append(
            [
                _num(lv.get("machines"), "{:,}"),
                _num(lv.get("workers", 1), "{}"),
                _num(lv.get("msgs_per_s"), "{:,.0f}"),
                "yes" if lv.get("keeps_up") else f"no (lag {_num(lv.get('final_lag'), '{:,.0f}')})",
                _pair(lv.get("xid_p50_s"), lv.get("xid_p99_s"), "{:.2f}"),
                f"{_num(lv.get('worker_cpu_ms_per_1k'), '{:.0f}')} ({processed})",
                _num(lv.get("worker_core_util_pct"), "{:.0f} %"),
                _num(lv.get("sink_cpu_ms_per_1k"), "{:.0f}") if sink_process else "(in the worker)",
            ]
        )
    return head, rows


BENCHES: dict[str, Callable[[Any], Table]] = {
    "demo_runs": demo_runs,
    "chaos": chaos,
    "stream_load": stream_load,
}


def markdown(head: list[str], rows: list[list[str]], rows_only: bool = False) -> str:
    lines = [] if rows_only else ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def load(text: str) -> Any:
    """The JSON document of a file, or of its last line: ``stream_load.py --json`` prints its
    tables first and the JSON object last, on one line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(text.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench", choices=sorted(BENCHES))
    parser.add_argument("file", type=Path, help="the bench's JSON output ('-': stdin)")
    parser.add_argument("--rows-only", action="store_true", help="no header lines")
    args = parser.parse_args(argv)
    text = sys.stdin.read() if str(args.file) == "-" else args.file.read_text()
    data = load(text)
    head, rows = BENCHES[args.bench](data)
    print(markdown(head, rows, args.rows_only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
