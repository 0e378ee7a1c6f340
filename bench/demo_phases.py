"""Where the demo's incidents spend their time: per fault, the median over runs of each phase.

    .venv/bin/python bench/demo_phases.py ~/.local/share/trainguard/demo-runs/run*-summary.json [--json]

Reads the summaries `trainguard demo --summary-json` wrote (``bench/demo_runs.py`` keeps one per
run in ``<stack home>/demo-runs``) and prints a Markdown table, one row per fault of the scenario:
the median over the runs of ``detect`` (injection -> first detection), ``localise`` (-> a
decision naming machines), ``decide`` (-> the acting decision), ``takeover`` (a hung loader its
shadow loader took over: injection -> the takeover), each recovery step as the action service
timed it (``replenish`` runs after the restart, so training does not wait for it), ``first_step``
(the restart's end -> the first training step) and ``recovered`` (injection -> stepping again).
A phase an incident did not have (a tolerated NIC flap restarts nothing) is left out of its
median; "-" where no run had it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

PHASES = ("detect", "localise", "decide")
#: recovery steps in the order a recovery runs them; any other step goes after these.
STEP_ORDER = ("stop", "diagnose", "evict", "swap_standbys", "hot_update", "restart", "replenish")


def collect(
    summaries: list[dict[str, Any]],
) -> tuple[list[str], list[str], dict[str, dict[str, list[float]]]]:
    """(faults in scenario order, step columns, fault -> column -> values over the runs)."""
    faults: list[str] = []
    steps: set[str] = set()
    values: dict[str, dict[str, list[float]]] = {}
    for summary in summaries:
        for inc in summary.get("incidents", []):
            fault = str(inc["fault"])
            if fault not in values:
                faults.append(fault)
                values[fault] = {}
            cols = values[fault]
            phases = inc.get("phases") or {}
            for name in (*PHASES, "takeover", "first_step"):
                if phases.get(name) is not None:
                    cols.setdefault(name, []).append(float(phases[name]))
            for step, seconds in (phases.get("steps") or {}).items():
                steps.add(step)
                cols.setdefault(f"step:{step}", []).append(float(seconds))
            if inc.get("recovered_s") is not None:
                cols.setdefault("recovered", []).append(float(inc["recovered_s"]))
    ordered = [s for s in STEP_ORDER if s in steps] + sorted(steps - set(STEP_ORDER))
    return faults, ordered, values


def medians(values: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    return {
        fault: {col: statistics.median(v) for col, v in cols.items() if v} for fault, cols in values.items()
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("summaries", nargs="+", type=Path, help="summary JSON files, one per run")
    ap.add_argument("--json", action="store_true", help="print {fault: {phase: median s}} instead")
    args = ap.parse_args()
    summaries = [json.loads(p.read_text()) for p in args.summaries]
    faults, steps, values = collect(summaries)
    table = medians(values)
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    # A hung loader its shadow loader took over: injection -> the takeover (no recovery steps).
    takeover = ["takeover"] if any("takeover" in cols for cols in values.values()) else []
    cols = [*PHASES, *takeover, *(f"step:{s}" for s in steps), "first_step", "recovered"]
    heads = [*PHASES, *takeover, *steps, "first step", "recovered"]
    print(f"median of {len(summaries)} run(s), seconds")
    print("| fault | " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * len(heads))
    for fault in faults:
        row = table[fault]
        cells = [f"{row[c]:.1f}" if c in row else "-" for c in cols]
        print(f"| {fault} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
