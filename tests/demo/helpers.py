"""Shared helpers of the demo tests: spec factory, what a wait names, reading rank logs.

Tests that launch processes give their gloo rendezvous a free port (``tests.net.free_port``) and
wait with ``tests.waiting.wait_until``.
"""

from __future__ import annotations

import re
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
