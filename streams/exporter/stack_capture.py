"""On-demand stack capture (the paper's On-Demand Tracer, §2/§5) with py-spy.

A capture dumps the Python stacks of every training process and all its children (dataloader
workers, checkpoint writers) with ``py-spy dump --json``, several processes at once, and
publishes one :class:`~trainguard.schemas.workload.StackDump` per process tagged with job, rank, pid, role,
the capture id and the round, plus the rank's process tree.  ``rounds`` x ``interval_s`` serves
the fail-slow case (the analyzer votes over 5 rounds 10 s apart).  A process that vanished or
that py-spy cannot read still yields a dump, with ``error`` set: a missing stack is evidence.
Captures run on their own thread; sampling continues meanwhile.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainguard.infra.proctable import DEAD_STATES, LIVE, STOPPED_STATES
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.enums import ProcessRole
from trainguard.schemas.workload import Frame, StackDump, ThreadStack
from trainguard.streams.exporter.config import StacksConfig
from trainguard.streams.exporter.sources.process import TrackedProcess

log = logging.getLogger(__name__)

#: a capture round slower than this is logged: py-spy takes tens of ms a process, even on a
#: loaded host, so a slow round means the processes or the host stalled the dump.
SLOW_ROUND_S = 1.0

#: frames that identify a process's role when its name did not (fork start method, old torch).
_DATALOADER_FRAME = re.compile(r"torch/utils/data/_utils/worker\.py$")
_CHECKPOINT_FRAME = re.compile(r"(?i)checkpoint|ckpt")


def parse_pyspy_json(text: str) -> dict[int, list[ThreadStack]]:
    """``py-spy dump --json`` output (a list of thread traces) -> threads by pid, innermost first.

    >>> out = parse_pyspy_json('[{"pid": 7, "thread_id": 1, "thread_name": "MainThread", "active": true,'
    ...     ' "owns_gil": false, "frames": [{"name": "f", "filename": "/a.py", "line": 3, "module": null}]}]')
    >>> out[7][0].frames[0]
    Frame(function='f', filename='/a.py', line=3, module='')
    """
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError(f"py-spy JSON: expected a list of threads, got {type(data).__name__}")
    out: dict[int, list[ThreadStack]] = {}
    for t in data:
        frames = [
            Frame(
                function=str(f.get("name") or "")[:1024],
                filename=str(f.get("filename") or "")[:4096],
                line=max(0, int(f.get("line") or 0)),
                module=str(f.get("module") or "")[:1024],
            )
            for f in t.get("frames") or []
        ]
        out.setdefault(int(t.get("pid") or 0), []).append(
            ThreadStack(
                thread_id=int(t.get("thread_id") or 0) % 2**64,
                name=str(t.get("thread_name") or "")[:1024],
                active=bool(t.get("active", True)),
                owns_gil=bool(t.get("owns_gil", False)),
                frames=frames,
            )
        )
    return out


def render_text(pid: int, threads: list[ThreadStack]) -> str:
    """py-spy's text layout, for humans reading a postmortem."""
    lines = [f"Process {pid}"]
    for t in threads:
        state = "active" if t.active else "idle"
        gil = "+gil" if t.owns_gil else ""
        lines.append(f"Thread {t.thread_id:#x} ({state}{gil}): {t.name!r}")
        lines += [f"    {f.function} ({f.filename}:{f.line})" for f in t.frames]
    return "\n".join(lines) + "\n"


def refine_role(role: ProcessRole, threads: list[ThreadStack]) -> ProcessRole:
    """Use the stack to name an ``other`` child: dataloader worker loop or checkpoint code.

    >>> t = ThreadStack(frames=[Frame("_worker_loop", ".../torch/utils/data/_utils/worker.py", 300)])
    >>> refine_role(ProcessRole.OTHER, [t]).value
    'dataloader'
    """
    if role is not ProcessRole.OTHER:
        return role
    files = [f.filename for t in threads for f in t.frames]
    if any(_DATALOADER_FRAME.search(f) for f in files):
        return ProcessRole.DATALOADER
    if any(
        _CHECKPOINT_FRAME.search(f.filename) or _CHECKPOINT_FRAME.search(f.function)
        for t in threads
        for f in t.frames
    ):
        return ProcessRole.CHECKPOINT
    return role


def find_py_spy(name: str) -> str:
    """The py-spy executable: as configured, on PATH, or next to this Python (a venv)."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    if beside.exists():
        return str(beside)
    raise FileNotFoundError(f"py-spy not found ({name!r} is not on PATH nor beside {sys.executable})")


class StackCapturer:
    """Runs captures on request; ``discover`` lists the training processes at each round."""

    def __init__(
        self,
        cfg: StacksConfig,
        node: str,
        job: str,
        discover: Callable[[], list[TrackedProcess]],
        publish: Callable[[Event], None],
    ) -> None:
        self.cfg, self.node, self.job = cfg, node, job
        self.discover, self.publish = discover, publish
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.captures = 0
        self.errors = 0

    def dump(self, pid: int, state: str = "") -> tuple[list[ThreadStack], str]:
        """Threads of one process, or ([], why not).

        A stopped process (state ``T``/``t``: SIGSTOP, a debugger) is read without suspending it
        (``--nonblocking``): py-spy's suspend fails on it at once ("Failed to suspend process",
        measured with py-spy 0.4.3), and its stacks cannot change while it is stopped anyway.
        Without that, a SIGSTOPped rank -- the very suspect of a hang -- answered no stack and its
        capture waited for the deadline."""
        try:
            cmd = [find_py_spy(self.cfg.py_spy), "dump", "--pid", str(pid), "--json"]
        except FileNotFoundError as exc:
            return [], str(exc)
        if self.cfg.native:
            cmd.append("--native")
        if state in STOPPED_STATES:
            cmd.append("--nonblocking")
        failed = ""
        for _attempt in range(2):
            if "suspend" in failed and "--nonblocking" not in cmd:
                cmd.append("--nonblocking")  # stopped between the process scan and the dump
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=self.cfg.timeout_s)
            except subprocess.TimeoutExpired:
                return [], f"py-spy timed out after {self.cfg.timeout_s} s"
            # A sample can fail transiently (threads starting/exiting while py-spy reads them):
            # try once more while the process still runs.
            if res.returncode == 0 or failed or not LIVE.alive(pid):
                break
            failed = res.stderr or res.stdout or "failed"
        if res.returncode != 0:
            return [], (res.stderr or res.stdout).strip()[-4000:] or f"py-spy exited {res.returncode}"
        try:
            by_pid = parse_pyspy_json(res.stdout)
        except (ValueError, TypeError, AttributeError) as exc:
            return [], f"unparsable py-spy output: {exc}"
        return by_pid.get(pid, [t for ts in by_pid.values() for t in ts]), ""

    def capture_round(self, capture_id: str, round_no: int) -> list[StackDump]:
        procs = [
            p for p in self.discover() if p.state not in DEAD_STATES and (p.rank >= 0 or self.cfg.unranked)
        ]
        with ThreadPoolExecutor(max_workers=self.cfg.parallel, thread_name_prefix="py-spy") as pool:
            results = list(pool.map(lambda p: self.dump(p.pid, p.state), procs))
        dumps = []
        for p, (threads, error) in zip(procs, results, strict=True):
            if error:
                self.errors += 1
            tree = [q.info() for q in procs if (q.rank, q.job) == (p.rank, p.job)]
            dumps.append(
                StackDump(
                    job=p.job or self.job,  # a registered rank's own job (an exporter may have none)
                    node=self.node,
                    rank=p.rank,
                    pid=p.pid,
                    capture_id=capture_id,
                    ts_ms=now_ms(),
                    role=refine_role(p.role, threads),
                    round=round_no,
                    threads=threads,
                    process_tree=tree,
                    raw_text=render_text(p.pid, threads)[:1_000_000],
                    error=error[:4096],
                )
            )
        return dumps

    def run(self, capture_id: str, rounds: int, interval_s: float, first_round: int = 0) -> None:
        """All rounds of one capture (blocking), numbered from ``first_round``; each round's dumps
        are published as they come."""
        for i in range(rounds):
            r = first_round + i
            # More rounds of a capture wait an interval too: right after the last round, a new
            # one would sample the job in the same state again.
            if (i or first_round) and self._stop.wait(interval_s):
                return
            started = time.monotonic()
            dumps = self.capture_round(capture_id, r)
            took = time.monotonic() - started
            if took > SLOW_ROUND_S:  # py-spy takes tens of ms a process: something waited
                log.warning(
                    "capture %s round %d took %.1f s for %d processes", capture_id, r, took, len(dumps)
                )
            for dump in dumps:
                self.publish(dump)
            log.info("capture %s round %d/%d published", capture_id, r + 1, first_round + rounds)
        self.captures += 1

    def request(
        self, capture_id: str, rounds: int, interval_s: float, first_round: int = 0
    ) -> threading.Thread:
        t = threading.Thread(
            target=self._guarded,
            args=(capture_id, rounds, interval_s, first_round),
            name=f"capture-{capture_id[:8]}",
            daemon=True,
        )
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()
        return t

    def _guarded(self, *args: Any) -> None:
        try:
            self.run(*args)
        except Exception:
            self.errors += 1
            log.exception("stack capture %s failed", args[0])

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
