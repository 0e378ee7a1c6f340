"""Stop-time diagnostics (ByteRobust §4.2-§4.3) as real torch code, one subprocess per machine.

* **Bit-wise alignment** -- every machine builds the same small reference model from a fixed seed,
  runs one training step on fixed input, and hashes the resulting parameters.  Healthy machines
  produce bit-identical digests; the odd one out (a faulty ALU, silent data corruption) is suspect.
  With no strict majority nobody can be trusted, so every machine is flagged.
* **Collective connectivity** -- all-gather over gloo between each machine and its ring
  neighbour (the paper tests "each machine and its neighbours"), checking both that the collective
  completes within the timeout and that every gathered tensor holds exactly what its sender sent.
  A machine is suspect when *all* its pairs fail; if every pair fails, all machines are flagged
  (a fabric-wide problem is not one machine's fault -- the blast-radius guard then holds it).

Run on a machine as ``python -m actions.diagnostics alignment`` or ``... connectivity --rank R
--world 2 --port P``; each prints one JSON object.  :func:`run_local` runs both for N local
"machines" (one process per machine and test, on 127.0.0.1), with injectable faults for tests and
the demo.  Those processes are forked from a server that has already imported torch (see
:func:`serve`; :func:`prewarm` starts it ahead of time), so a diagnosis takes a second or two
rather than the seconds per process that a cold ``import torch`` costs.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import hashlib
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from actions.executors.base import DiagnosticResult

#: the reference model is tiny on purpose: the test checks arithmetic, not throughput.
_IN, _HIDDEN, _BATCH = 32, 64, 16


def alignment_digest(perturb: bool = False) -> str:
    """SHA-256 of the reference model's parameters after one fixed training step."""
    import torch

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # reduction order depends on the thread count; keep it fixed
    g = torch.Generator().manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(_IN, _HIDDEN), torch.nn.GELU(), torch.nn.Linear(_HIDDEN, _IN)
    ).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1)
    x = torch.randn(_BATCH, _IN, generator=g, dtype=torch.float64)
    y = torch.randn(_BATCH, _IN, generator=g, dtype=torch.float64)
    if perturb:  # low bits wrong in one input: what a marginal core does to a real step
        x[0, 0] *= 1 + 2**-30
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def connectivity_check(
    rank: int, world: int, port: int, timeout_s: float, corrupt: bool = False
) -> dict[str, Any]:
    """All-gather over gloo on 127.0.0.1:``port``; verifies every peer's payload bit for bit."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    t0 = time.monotonic()
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        mine = torch.full((4096,), float(rank + 1))
        if corrupt:  # a NIC/PCIe path that flips data in flight
            mine[7] += 0.5
        out = [torch.zeros(4096) for _ in range(world)]
        dist.all_gather(out, mine)
        bad = [i for i, t in enumerate(out) if not torch.equal(t, torch.full((4096,), float(i + 1)))]
        dist.destroy_process_group()
        ok, detail = not bad, f"corrupted payload from rank(s) {bad}" if bad else "ok"
    except Exception as exc:  # timeouts and refused connections are test results, not crashes
        ok, detail = False, f"{type(exc).__name__}: {str(exc)[:300]}"
    return {"ok": ok, "detail": detail, "ms": (time.monotonic() - t0) * 1000}


# --- running the tests on local "machines" (subprocesses) -----------------------------------------


@dataclass(frozen=True)
class LocalFaults:
    """Injected faults for local runs: which machines misbehave, and how."""

    perturb: frozenset[str] = frozenset()  # wrong alignment arithmetic
    corrupt: frozenset[str] = frozenset()  # corrupts all-gather payloads
    absent: frozenset[str] = frozenset()  # never joins the collective (unreachable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the test-process server: forks each test from a process that already imported torch ---------
#
# Cold-starting a python that imports torch costs seconds per process; a diagnosis of N machines
# needs ~3N of them.  So one long-lived server process (``python -m actions.diagnostics serve``,
# a plain subprocess, started on first use or by :func:`prewarm`) imports torch once and forks a
# fresh child per test.  The server itself never runs torch code -- no thread pools, no process
# groups -- so forking it is safe; every test still runs in its own OS process and creates its
# gloo group there.  Requests and answers are JSON lines on the server's stdin/stdout:
#
#   caller -> server   {"id": 1, "test": "alignment", "args": {...}}    {"id": 1, "kill": true}
#   server -> caller   {"ready": pid}  {"id": 1, "pid": 123}  {"id": 1, "result": {...}} (from the
#                      child)  {"id": 1, "exit": 0}  (once the child is reaped: the job is over)
#
# (Not multiprocessing's forkserver: its children re-run the caller's ``__main__`` script, which
# costs time in every child and breaks for unguarded scripts, and its preload list is global.)

#: tests a server child can run, by name.
_TESTS: dict[str, Callable[..., dict[str, Any]]] = {
    "alignment": lambda perturb=False: {"ok": True, "digest": alignment_digest(perturb)},
    "connectivity": lambda **kw: connectivity_check(**kw),
}
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
            result = _TESTS[test](**args)
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
    """The server loop (``python -m actions.diagnostics serve``); returns when stdin closes."""
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
            [sys.executable, "-m", "actions.diagnostics", "serve"],
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


def _run_tests(requests: list[tuple[str, dict[str, Any]]], timeout_s: float) -> list[dict[str, Any]]:
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


def run_alignment(
    machines: list[str], faults: LocalFaults, timeout_s: float = 60.0
) -> list[DiagnosticResult]:
    t0 = time.monotonic()
    found = _run_tests([("alignment", {"perturb": m in faults.perturb}) for m in machines], timeout_s)
    answers = dict(zip(machines, found, strict=True))
    ms = (time.monotonic() - t0) * 1000
    digests: dict[str, str] = {m: str(a["digest"]) for m, a in answers.items() if a.get("digest")}
    common, count = collections.Counter(digests.values()).most_common(1)[0] if digests else ("", 0)
    majority = count * 2 > len(machines)
    out = []
    for m in machines:
        d = digests.get(m)
        if d is None:
            out.append(DiagnosticResult(m, "alignment", False, answers[m].get("detail", "no digest"), ms))
        elif not majority:
            out.append(DiagnosticResult(m, "alignment", False, f"no majority digest ({d[:12]})", ms))
        else:
            detail = "bit-identical" if d == common else f"digest {d[:12]} != majority {common[:12]}"
            out.append(DiagnosticResult(m, "alignment", d == common, detail, ms))
    return out


def ring_pairs(n: int) -> list[tuple[int, int]]:
    """Each machine with its ring neighbour (one pair for two machines)."""
    if n < 2:
        return []
    return [(0, 1)] if n == 2 else [(i, (i + 1) % n) for i in range(n)]


def run_connectivity(
    machines: list[str], faults: LocalFaults, timeout_s: float = 20.0
) -> list[DiagnosticResult]:
    t0 = time.monotonic()
    pairs = ring_pairs(len(machines))
    requests: list[tuple[str, dict[str, Any]]] = []
    slots: list[list[int | None]] = []  # per pair and side: the index of its request, None if absent
    for a, b in pairs:
        port = free_port()
        slots.append([])
        for rank, idx in enumerate((a, b)):
            m = machines[idx]
            if m in faults.absent:
                slots[-1].append(None)
                continue
            slots[-1].append(len(requests))
            args = {"rank": rank, "world": 2, "port": port, "timeout_s": timeout_s}
            requests.append(("connectivity", {**args, "corrupt": m in faults.corrupt}))
    found = _run_tests(requests, timeout_s + 30)
    passed: dict[tuple[int, int], bool] = {}
    details: dict[int, list[str]] = collections.defaultdict(list)
    for (a, b), sides in zip(pairs, slots, strict=True):
        answers = [found[s] if s is not None else {"ok": False, "detail": "absent"} for s in sides]
        passed[(a, b)] = all(x.get("ok") for x in answers)
        for idx, ans in zip((a, b), answers, strict=True):
            details[idx].append(f"with {machines[b if idx == a else a]}: {ans.get('detail')}")
    ms = (time.monotonic() - t0) * 1000
    everything_failed = bool(passed) and not any(passed.values())
    out = []
    for i, m in enumerate(machines):
        mine = [ok for pair, ok in passed.items() if i in pair]
        ok = not everything_failed and (not mine or any(mine))
        out.append(DiagnosticResult(m, "connectivity", ok, "; ".join(details[i]) or "no peer", ms))
    return out


def run_local(
    machines: list[str], tests: Iterable[str], faults: LocalFaults | None = None, timeout_s: float = 30.0
) -> list[DiagnosticResult]:
    """Both stop-time tests for local machines (subprocesses); one result per (machine, test)."""
    faults = faults or LocalFaults()
    out: list[DiagnosticResult] = []
    for test in tests:
        if test == "alignment":
            out += run_alignment(machines, faults, timeout_s * 2)
        elif test == "connectivity":
            out += run_connectivity(machines, faults, timeout_s)
        else:
            raise ValueError(f"unknown test {test!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m actions.diagnostics", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="test", required=True)
    a = sub.add_parser("alignment", help="print the reference step's parameter digest")
    a.add_argument("--perturb", action="store_true", help="inject a one-ulp arithmetic fault")
    c = sub.add_parser("connectivity", help="gloo all-gather with peers on 127.0.0.1")
    c.add_argument("--rank", type=int, required=True)
    c.add_argument("--world", type=int, required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--timeout", type=float, default=20.0)
    c.add_argument("--corrupt", action="store_true", help="send a corrupted payload")
    sub.add_parser("serve", help="fork the tests asked for on stdin (JSON lines); used by run_local")
    ns = p.parse_args(argv)
    if ns.test == "serve":
        return serve()
    if ns.test == "alignment":
        print(json.dumps({"ok": True, "digest": alignment_digest(ns.perturb)}))
    else:
        print(json.dumps(connectivity_check(ns.rank, ns.world, ns.port, ns.timeout, ns.corrupt)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
