"""Local server processes with pid files: start detached, find again, stop only our own.

A pid file alone is not proof of ownership (pids are reused), so :meth:`ManagedProcess.pid`
also checks that the live process's command line contains the marker we started it with
(the server's own config path, unique per stack home).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainguard.infra.proctable import LIVE


class StackError(RuntimeError):
    """A clear, user-facing problem with the local stack (no traceback needed)."""


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


@dataclass
class ManagedProcess:
    """One server process owned by a stack home."""

    name: str
    pid_file: Path
    log_file: Path
    #: a string that appears in the process's command line only if we started it.
    marker: str

    def pid(self) -> int | None:
        """The live pid of our process, or None (stale pid files are removed)."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        if not LIVE.alive(pid):  # gone, or a zombie
            self.pid_file.unlink(missing_ok=True)
            return None
        cmd = LIVE.cmdline(pid)
        # An empty cmdline is transient (the process is mid-exec): not proof of a stale pid.
        if cmd == "" and LIVE.exists(pid):
            return pid
        if self.marker in cmd:
            return pid
        self.pid_file.unlink(missing_ok=True)
        return None

    def start(self, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=cwd,
                env=env,
                start_new_session=True,  # survives the CLI exiting; not killed by the CLI's Ctrl-C
            )
        self.pid_file.write_text(str(proc.pid))
        return proc.pid

    def exited_early(self) -> bool:
        return self.pid() is None

    def stop(self, timeout_s: float = 30.0) -> bool:
        """SIGTERM, wait, then SIGKILL. Returns True if a process was stopped."""
        pid = self.pid()
        if pid is None:
            return False
        _signal(pid, signal.SIGTERM)
        if not _wait(lambda: not _alive(pid), timeout_s):
            _signal(pid, signal.SIGKILL)
            _wait(lambda: not _alive(pid), 10)
        self.pid_file.unlink(missing_ok=True)
        return True

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _alive(pid: int) -> bool:
    if not LIVE.alive(pid):
        with contextlib.suppress(ChildProcessError):  # reap it if it is our child (tests start servers)
            os.waitpid(pid, os.WNOHANG)
        return False
    return True


def _wait(pred: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval_s)
    return pred()


def wait_until(pred: Callable[[], bool], timeout_s: float, what: str, proc: ManagedProcess) -> None:
    """Wait for ``pred``; fail fast with the log tail if the process died meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        if proc.exited_early():
            raise StackError(f"{proc.name} exited during start-up; last log lines:\n{proc.log_tail()}")
        time.sleep(0.2)
    raise StackError(f"{what} not healthy after {timeout_s:.0f}s; last log lines:\n{proc.log_tail()}")
