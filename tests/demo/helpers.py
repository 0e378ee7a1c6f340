"""Shared helpers of the demo tests: spec factory, waiting on progress files, reading rank logs."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from trainguard_demo.config import JobSpec
from trainguard_demo.launcher import JobHandle

# Each test launching processes takes its own port in 29600-29699 (the brief's range).
PORTS = {"job": 29601, "resume": 29602, "faults": 29610}


def make_spec(tmp: Path, port: int, **kw: Any) -> JobSpec:
    base: dict[str, Any] = {"job": "t", "cluster_dir": str(tmp), "master_port": port, "pg_timeout_s": 60.0}
    return JobSpec(**{**base, **kw})


def wait_until(pred: Any, timeout: float, what: str, handle: JobHandle | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    detail = ""
    if handle is not None:
        detail = "\n".join(f"{p.rank}: {p.poll()} {p.stderr.read_text()[-800:]}" for p in handle.procs)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{detail}")


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
