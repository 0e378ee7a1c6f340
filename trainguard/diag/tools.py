"""Running an external diagnostic tool (``dcgmi``, ``all_reduce_perf``) under a time limit.

The tool runs in a session of its own, so a timeout kills what it started too (``mpirun``'s
ranks, a shell's children): nothing is left holding a GPU or the output pipes after the test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolRun:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def tail(self) -> str:
        """The end of its output, for a finding."""
        return (self.stdout + ("\n" + self.stderr if self.stderr else "")).strip()[-1500:]


def run_tool(argv: list[str], timeout_s: float, env: Mapping[str, str]) -> ToolRun:
    """Run ``argv`` to completion or ``timeout_s``, whichever is first (then its process group is
    killed and what it printed so far is returned)."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=dict(env),
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return ToolRun(proc.returncode, out, err, timed_out=False)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(proc.pid, signal.SIGKILL)  # the group this call created, nothing else
        out, err = proc.communicate()
        return ToolRun(proc.returncode, out, err, timed_out=True)
