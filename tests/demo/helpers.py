"""Shared helpers of the demo tests: spec factory, what a wait names, reading rank logs, a short
``trainguard demo`` run.

Tests that launch processes give their gloo rendezvous a free port (``tests.net.free_port``) and
wait with ``tests.waiting.wait_until``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard_demo.config import LaunchSpec
from trainguard_demo.launcher import JobHandle


def make_spec(tmp: Path, port: int, **kw: Any) -> LaunchSpec:
    base: dict[str, Any] = {"job": "t", "cluster_dir": str(tmp), "master_port": port, "pg_timeout_s": 60.0}
    return LaunchSpec(**{**base, **kw})


def with_ranks(what: str, handle: JobHandle | None) -> Callable[[], str]:
    """``what`` for ``wait_until``, followed (on a timeout) by each rank's exit code and stderr tail."""

    def describe() -> str:
        if handle is None:
            return what
        ranks = "\n".join(f"{p.rank}: {p.poll()} {p.stderr.read_text()[-800:]}" for p in handle.procs)
        return f"{what}\n{ranks}"

    return describe


def losses(log: Path) -> dict[int, float]:
    """step -> loss from a rank's stdout log."""
    out = {}
    for m in re.finditer(r"step (\d+) loss (\S+) ", log.read_text()):
        out[int(m.group(1))] = float(m.group(2))
    return out


def step_times(log: Path) -> dict[int, float]:
    return {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(r"step (\d+) .*step_time (\S+)s", log.read_text())
    }


def run_demo(cluster: str, tmp_path: Path) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """``trainguard demo --cluster CLUSTER`` with an Xid on machine 0 and a crash on machine 1
    (15 s apart), both recovered and the Xid's node evicted: its summary and the finished process."""
    import yaml

    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(
        yaml.safe_dump(
            [{"fault": "xid", "machine": 0, "after_s": 15}, {"fault": "crash", "machine": 1, "after_s": 15}]
        )
    )
    summary_file = tmp_path / "summary.json"
    trainguard = str(Path(sys.executable).with_name("trainguard"))
    argv = [
        trainguard,
        "demo",
        "--cluster",
        cluster,
        "--scenario",
        str(scenario),
        "--summary-json",
        str(summary_file),
    ]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=840, env=os.environ.copy())
    out = res.stdout[-6000:] + res.stderr[-3000:]
    assert res.returncode == 0, out
    summary = json.loads(summary_file.read_text())
    assert [i["fault"] for i in summary["incidents"]] == ["xid", "crash"], out
    assert all(i["recovered"] for i in summary["incidents"]), out
    xid = summary["incidents"][0]
    assert xid["machine"] == "n1" and xid["action"] == "evict", out
    return summary, res
