"""The agent's side of one zygote (:mod:`trainguard.agent.zygote`): start it, wait until it is
warm, ask it to fork ranks, and hear when a rank or the zygote itself ends."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import trainguard


class ZygoteError(RuntimeError):
    """The zygote is not there to fork from (failed, died, or not warm yet)."""


class Zygote:
    """A running zygote for one code version; ``on_exit(pid, code)`` hears each forked rank end."""

    def __init__(
        self,
        preload: list[str],
        code_dir: str,
        log_path: Path,
        env: dict[str, str],
        on_exit: Callable[[int, int], None],
    ) -> None:
        self.preload, self.code_dir, self.on_exit = preload, code_dir, on_exit
        self.ready = threading.Event()
        #: set when the zygote is gone (failed imports, killed, crashed).
        self.dead = threading.Event()
        self.error = ""
        self.import_s = 0.0
        self._forked: dict[str, int] = {}
        self._forked_cv = threading.Condition()
        self._write_lock = threading.Lock()
        env = dict(env)
        # The version's own modules win over anything installed; then this very trainguard (an
        # agent run from a checkout must not start an installed copy's zygote).
        paths = (code_dir, str(Path(trainguard.__file__).resolve().parent.parent), env.get("PYTHONPATH", ""))
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            cmd = [sys.executable, "-m", "trainguard.agent.zygote", "--preload", ",".join(preload)]
            if code_dir:
                cmd += ["--code-dir", code_dir]
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env
            )
        self.started = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="agent-zygote-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def warm(self) -> bool:
        return self.ready.is_set() and not self.dead.is_set()

    def wait_ready(self, timeout_s: float) -> bool:
        """True once warm; False if it died or ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while not self.ready.is_set() and not self.dead.is_set() and time.monotonic() < deadline:
            self.ready.wait(0.05)
        return self.warm

    def _read(self) -> None:
        out: IO[bytes] | None = self.proc.stdout
        assert out is not None
        for raw in out:
            try:
                msg: dict[str, Any] = json.loads(raw)
            except ValueError:
                continue
            op = msg.get("op")
            if op == "ready":
                self.import_s = float(msg.get("import_s", 0.0))
                self.ready.set()
            elif op == "failed":
                self.error = str(msg.get("error", "failed"))
            elif op == "forked":
                with self._forked_cv:
                    self._forked[str(msg["tag"])] = int(msg["pid"])
                    self._forked_cv.notify_all()
            elif op == "exit":
                self.on_exit(int(msg["pid"]), int(msg["code"]))
        code = self.proc.wait()
        if not self.error:
            self.error = f"zygote exited with code {code}"
        self.dead.set()
        with self._forked_cv:
            self._forked_cv.notify_all()

    def fork(self, tag: str, env: dict[str, str], entry: tuple[str, str, list[str]], log: Path) -> int:
        """The pid of a new rank forked with ``env``; ZygoteError when the zygote is not warm."""
        if not self.warm:
            raise ZygoteError(f"zygote not warm: {self.error or 'still importing'}")
        log.parent.mkdir(parents=True, exist_ok=True)
        req = {"op": "fork", "tag": tag, "env": env, "entry": list(entry), "log": str(log)}
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            with self._write_lock:
                stdin.write((json.dumps(req) + "\n").encode())
                stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as exc:
            raise ZygoteError(f"zygote gone: {exc}") from None
        with self._forked_cv:
            # A fork takes milliseconds; 30 s means the zygote is stuck.
            if not self._forked_cv.wait_for(lambda: tag in self._forked or self.dead.is_set(), 30.0):
                raise ZygoteError("zygote did not answer a fork request within 30 s")
            if tag not in self._forked:
                raise ZygoteError(f"zygote died during a fork: {self.error}")
            return self._forked.pop(tag)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close its stdin (it stops its remaining children and exits), then make sure it did."""
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout_s)
        self._reader.join(timeout_s)
