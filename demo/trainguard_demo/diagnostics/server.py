"""The diagnostics test server: forks each stop-time test from a process that already imported torch.

Cold-starting a python that imports torch costs seconds per process; a diagnosis of N machines
needs ~3N of them.  So one long-lived server process (``python -m trainguard_demo.diagnostics serve``,
a plain subprocess, started on first use or by :func:`prewarm`) imports torch once and forks a
fresh child per test.  The server itself never runs torch code -- no thread pools, no process
groups -- so forking it is safe; every test still runs in its own OS process and creates its
gloo group there.  Requests and answers are JSON lines on the server's stdin/stdout::

  caller -> server   {"id": 1, "test": "alignment", "args": {...}}    {"id": 1, "kill": true}
  server -> caller   {"ready": pid}  {"id": 1, "pid": 123}  {"id": 1, "result": {...}} (from the
                     child)  {"id": 1, "exit": 0}  (once the child is reaped: the job is over)

(Not multiprocessing's forkserver: its children re-run the caller's ``__main__`` script, which
costs time in every child and breaks for unguarded scripts, and its preload list is global.)
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import importlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NoReturn

from trainguard_demo.diagnostics.tests import TESTS

#: what the server imports before forking: imports only, no torch code runs there.  Besides torch
#: itself, what the tests would otherwise import lazily in every child (seconds on a loaded host:
#: ``torch.use_deterministic_algorithms`` imports inductor's config, which pulls dynamo and sympy).
_PRELOAD = ("ctypes", "torch", "torch.distributed", "torch._inductor.config", "datetime")
#: how long a killed test may take to be reaped before the server itself is given up on.
_KILL_GRACE_S = 5.0


def _line(msg: dict[str, Any]) -> bytes:
    """One protocol line; short enough (< PIPE_BUF) that concurrent writers never interleave."""
    data = json.dumps(msg).encode() + b"\n"
    if len(data) > 4000:
        short = {"id": msg.get("id"), "result": {"ok": False, "detail": "oversized answer"}}
        data = json.dumps(short).encode() + b"\n"
    return data


def _die_with_parent(parent: int) -> None:
    """Best effort (Linux): SIGKILL this process when ``parent``, which forked it, dies."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before that took effect
        os._exit(1)


def _child(out: int, rid: int, test: str, args: dict[str, Any], close: list[int], parent: int) -> NoReturn:
    """In a forked child: run one test, write its answer, exit without running any cleanup."""
    code = 0
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _die_with_parent(parent)
        for fd in close:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        try:
            result = TESTS[test](**args)
        except BaseException as exc:  # a crashing test is a failed test, reported as such
            result = {"ok": False, "detail": f"{type(exc).__name__}: {str(exc)[:300]}"}
        os.write(out, _line({"id": rid, "result": {**result, "pid": os.getpid()}}))
    except BaseException:
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            sys.stderr.flush()
        os._exit(code)


def serve() -> int:
    """The server loop (``python -m trainguard_demo.diagnostics serve``); returns when stdin closes."""
    for name in _PRELOAD:  # the point of the server: every child it forks inherits these
        with contextlib.suppress(ImportError):
            importlib.import_module(name)

    out = os.dup(1)  # the protocol channel; stray prints (gloo, warnings) go to stderr instead
    os.dup2(2, 1)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD wakes the select below
    signal.set_wakeup_fd(wake_w)
    running: dict[int, int] = {}  # child pid -> request id
    me = os.getpid()
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    os.write(out, _line({"ready": os.getpid()}))
    buf, stdin_open = b"", True
    while stdin_open or running:
        for key, _ in sel.select():
            if key.fd == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                continue
            data = os.read(0, 65536)
            if not data:  # the caller is gone: nobody wants the answers
                stdin_open = False
                sel.unregister(0)
                for pid in running:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                continue
            buf += data
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                try:
                    req = json.loads(raw)
                    rid = int(req["id"])
                except (ValueError, KeyError, TypeError):
                    continue
                if req.get("kill"):
                    for pid, job in running.items():
                        if job == rid:  # not reaped yet, so the pid is still this child's
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(pid, signal.SIGKILL)
                    continue
                try:
                    pid = os.fork()
                except OSError as exc:
                    os.write(out, _line({"id": rid, "exit": None, "error": f"fork failed: {exc}"}))
                    continue
                if pid == 0:
                    test, args = str(req.get("test")), dict(req.get("args") or {})
                    _child(out, rid, test, args, [wake_r, wake_w, sel.fileno()], me)
                running[pid] = rid
                os.write(out, _line({"id": rid, "pid": pid}))
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in running:
                os.write(out, _line({"id": running.pop(pid), "exit": os.waitstatus_to_exitcode(status)}))
    return 0


@dataclass
class _Job:
    """One test run by the server, as the caller sees it."""

    id: int
    done: threading.Event = field(default_factory=threading.Event)
    pid: int | None = None
    result: dict[str, Any] | None = None
    exit: int | None = None
    error: str | None = None

    def answer(self) -> dict[str, Any]:
        if self.result is not None:
            return self.result
        if self.error:
            return {"ok": False, "detail": self.error}
        how = f" ({signal.Signals(-self.exit).name})" if self.exit is not None and self.exit < 0 else ""
        return {"ok": False, "detail": f"exit {self.exit}{how} without an answer"}


class _Server:
    """The caller's handle on one server process; thread-safe."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard_demo.diagnostics", "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a ^C meant for the caller does not kill tests mid-run
        )
        self.lock = threading.Lock()
        self.jobs: dict[int, _Job] = {}
        self.next_id = 0
        self.ready = threading.Event()
        self.dead: str | None = None
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=10)
        threading.Thread(target=self._read, name="diagnostics-server", daemon=True).start()
        threading.Thread(target=self._read_stderr, name="diagnostics-server-err", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if "ready" in msg:
                self.ready.set()
                continue
            with self.lock:
                job = self.jobs.get(msg.get("id"))
                if job is not None and "exit" in msg:
                    del self.jobs[job.id]
            if job is None:
                continue
            if "pid" in msg:
                job.pid = msg["pid"]
            elif "result" in msg:
                job.result = msg["result"]
            elif "exit" in msg:
                job.exit, job.error = msg["exit"], msg.get("error")
                job.done.set()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        tail = " | ".join(self.stderr_tail)[-300:]
        self._fail(f"diagnostics server exited ({self.proc.returncode}): {tail}")

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            if line := raw.decode(errors="replace").strip():
                self.stderr_tail.append(line)

    def _fail(self, reason: str) -> None:
        """The server is unusable: every pending job fails now, the next caller starts a new one."""
        with self.lock:
            self.dead = self.dead or reason
            jobs, self.jobs = list(self.jobs.values()), {}
        for job in jobs:
            job.error = reason
            job.done.set()
        self.ready.set()

    def _send(self, msg: dict[str, Any]) -> bool:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(_line(msg))
            self.proc.stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    def submit(self, test: str, args: dict[str, Any]) -> _Job:
        with self.lock:
            self.next_id += 1
            job = _Job(self.next_id)
            sent = self.dead is None
            if sent:
                self.jobs[job.id] = job
                sent = self._send({"id": job.id, "test": test, "args": args})
        if not sent:
            self.close(self.dead or "diagnostics server unreachable")
            job.error = job.error or self.dead
            job.done.set()
        return job

    def kill(self, job: _Job) -> None:
        with self.lock:
            if job.id in self.jobs:
                self._send({"id": job.id, "kill": True})

    def alive(self) -> bool:
        return self.dead is None and self.proc.poll() is None

    def close(self, reason: str = "diagnostics server closed") -> None:
        """Stop the server (its running tests die with it) and fail whatever was pending."""
        with contextlib.suppress(OSError):
            self.proc.kill()
        self._fail(reason)

    def shutdown(self) -> None:
        """At exit: closing stdin lets the server kill its tests and leave on its own."""
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.close()


_server: _Server | None = None
_server_lock = threading.Lock()


def _get_server() -> _Server:
    global _server
    with _server_lock:
        if _server is None or not _server.alive():
            if _server is not None:
                _server.close("diagnostics server replaced")
            else:
                atexit.register(lambda: _server.shutdown() if _server is not None else None)
            _server = _Server()
        return _server


def prewarm(timeout_s: float = 120.0) -> bool:
    """Start the test server now and wait until it has imported torch, so that the first
    diagnosis does not pay for it; True once it is ready.  Safe to call from any thread, and
    meant for a background thread at service start-up."""
    server = _get_server()
    return server.ready.wait(timeout_s) and server.alive()


def run_tests(requests: list[tuple[str, dict[str, Any]]], timeout_s: float) -> list[dict[str, Any]]:
    """Run every ``(test, args)`` in its own process, concurrently; their answers, in order.  A
    test still running after ``timeout_s`` is killed; one that dies is a failed answer."""
    if not requests:
        return []
    server = _get_server()
    jobs = [server.submit(test, args) for test, args in requests]
    deadline = time.monotonic() + timeout_s
    answers = []
    for job in jobs:
        if job.done.wait(max(0.0, deadline - time.monotonic())):
            answers.append(job.answer())
            continue
        server.kill(job)
        if not job.done.wait(_KILL_GRACE_S):  # the server does not answer: replace it
            server.close("diagnostics server stopped answering")
        answers.append({"ok": False, "detail": f"no answer within {timeout_s:g} s"})
    return answers
