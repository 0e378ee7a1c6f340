"""bench/readme_table.py turns a bench's JSON into the rows of bench/README.md: three demo runs,
written as demo_runs.py writes runs.json, come back as rows in the page's table shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.readme_table import main

REPO = Path(__file__).resolve().parents[2]


def _run(wall_min: float, rec: int, ettr: float, base: float, low: float, det: tuple, recov: tuple) -> dict:
    return {
        "wall_s": wall_min * 60, "recovered": rec, "injected": 12, "ettr": ettr, "baseline_ettr": base,
        "sliding_ettr_min": low, "detect_p50_s": det[0], "detect_p90_s": det[1],
        "recover_p50_s": recov[0], "recover_p90_s": recov[1], "not_recovered": [], "exit": 1,
    }  # fmt: skip


def test_demo_runs_rows_are_the_pages_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = [
        _run(12.7, 12, 0.935, 0.239, 0.909, (1.2, 2.7), (8.5, 12.2)),
        _run(13.2, 11, 0.923, 0.360, 0.832, (1.2, 2.7), (7.0, 23.5)),
        _run(13.2, 11, 0.935, 0.346, 0.850, (1.0, 2.5), (6.5, 21.1)),
    ]
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(runs, indent=2))
    assert main(["demo_runs", str(path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("| run | wall | recovered | ETTR |")
    assert printed[2:] == [
        "| 1 | 12.7 min | 12/12 | 93.5% | 23.9% | 90.9% | 1.2 / 2.7 s | 8.5 / 12.2 s |",
        "| 2 | 13.2 min | 11/12 | 92.3% | 36.0% | 83.2% | 1.2 / 2.7 s | 7.0 / 23.5 s |",
        "| 3 | 13.2 min | 11/12 | 93.5% | 34.6% | 85.0% | 1.0 / 2.5 s | 6.5 / 21.1 s |",
    ]
    # The page's demo table has the header this prints (its rows are the latest runs').
    page = (REPO / "bench" / "README.md").read_text().splitlines()
    assert printed[0] in page and printed[1] in page


def test_a_failed_run_and_the_rows_only_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "runs.json"
    path.write_text(json.dumps([None]))
    assert main(["--rows-only", "demo_runs", str(path)]) == 0
    assert capsys.readouterr().out.strip() == "| 1 | failed | - | - | - | - | - | - |"


def test_chaos_and_stream_load_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chaos = {"scenarios": [{"name": "evict_storm", "passed": True, "produced": 72, "lost": 0,
                            "duplicated": 0, "accepted_forged": None, "decisions_expected": 72,
                            "decisions_made": 72, "decisions_acted": 32}]}  # fmt: skip
    (tmp_path / "chaos.json").write_text(json.dumps(chaos))
    assert main(["--rows-only", "chaos", str(tmp_path / "chaos.json")]) == 0
    assert capsys.readouterr().out.strip() == "| evict_storm | yes | 72 | 0 | 0 | - | 72 / 72 / 32 |"

    level = {"machines": 2400, "workers": 1, "msgs_per_s": 2960.0, "keeps_up": 1.0, "final_lag": 0,
             "xid_p50_s": 0.08, "xid_p99_s": 0.23, "worker_cpu_ms_per_1k": 193.2,
             "worker_cpu_ms_per_1k_processed": 225.4, "worker_core_util_pct": 54.1,
             "sink_cpu_ms_per_1k": 82.0}  # fmt: skip
    # As stream_load.py --json prints it: the object on the last line.
    (tmp_path / "load.json").write_text("progress\n" + json.dumps({"sink_process": True, "levels": [level]}))
    assert main(["--rows-only", "stream_load", str(tmp_path / "load.json")]) == 0
    assert (
        capsys.readouterr().out.strip()
        == "| 2,400 | 1 | 2,960 | yes | 0.08 / 0.23 s | 193 (225) | 54 % | 82 |"
    )
