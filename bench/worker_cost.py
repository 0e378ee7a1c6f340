"""What a process costs: its CPU time from /proc, and a py-spy profile aggregated into stages.

Used by ``bench/stream_load.py`` (and usable by any bench that starts a Python process):

* :func:`cpu_seconds` -- utime+stime of a process (``/proc/<pid>/stat`` counts all its threads,
  those already exited included) plus those of its live descendants;
* :func:`core_busy_seconds` -- how busy one core was (``/proc/stat``), to tell how much of it
  other processes took during a measurement on a shared machine;
* :class:`Profiler` -- ``py-spy record --format raw`` on a pid for a window, its samples
  aggregated into :data:`STAGES` by the innermost frame that matches the table.  Pass ``--gil``
  (``extra``) to count only the thread holding the GIL: without it py-spy's idle detection
  counts threads blocked in epoll/socket reads as busy, and the shares stop tracking CPU time.

The stage table is data: each stage lists path prefixes (``module/file.py`` under the repository
or site-packages, ``stdlib/...`` for the standard library), optionally ``:function``.  A sample
goes to the stage of its innermost frame that matches any prefix (stages tried in table order
for that frame), so a library frame called from product code is the library's stage, and a
standard-library frame (json, gzip, re) counts for the caller that matches.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")

#: (stage, prefixes): see the module docstring.  Order matters only between prefixes that match
#: the same frame (``schemas/codec.py:to_dict`` before ``schemas/codec.py``).
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("encode (to_dict/encode)", ("schemas/codec.py:to_dict", "schemas/codec.py:encode")),
    ("decode", ("schemas/codec.py",)),
    (
        "rule table / inspection",
        (
            "detectors/node_inspector.py",
            "detectors/rule_table.py",
            "detectors/log_classifier.py",
            "detectors/filters.py",
        ),
    ),
    ("windows / state", ("detectors/windows.py",)),
    ("anomaly score", ("detectors/node_anomaly.py", "detectors/anomaly/")),
    ("decide", ("detectors/decide.py", "detectors/planning.py")),
    ("training", ("detectors/job_monitor.py", "detectors/training.py", "detectors/stopped_job.py")),
    ("detection routing (other detectors/)", ("detectors/",)),
    ("sink encode (rows)", ("infra/clickhouse/rows.py",)),
    ("ClickHouse insert", ("clickhouse_connect/", "infra/clickhouse/")),
    ("sink loop / bus", ("infra/sink.py", "infra/bus.py")),
    ("Kafka: aiokafka (agents)", ("aiokafka/",)),
    ("Kafka: kafka-python (sink)", ("kafka/",)),
    ("metrics (prometheus)", ("prometheus_client/", "streams/metrics.py")),
    ("worker glue (streams/)", ("streams/",)),
    ("Faust / mode machinery", ("faust/", "mode/")),
    ("waiting (select/epoll, locks)", ("stdlib/selectors.py", "stdlib/threading.py:wait", "stdlib/queue.py")),
    ("asyncio machinery", ("stdlib/asyncio/",)),
    ("module import (lazy, one-time)", ("<frozen importlib",)),
)
OTHER = "other"

#: (component, prefixes), matched on the outermost frame first: which thread a sample is from.
COMPONENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sink thread", ("infra/sink.py",)),
    ("analyze thread pool", ("stdlib/concurrent/futures/thread.py",)),
    ("event loop (agents)", ("stdlib/asyncio/", "faust/", "mode/", "trainguard/")),
)

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
_STDLIB = re.compile(r"/lib/python3\.\d+/(?!site-packages/)")


def cpu_seconds(pid: int) -> float:
    """utime+stime of ``pid`` (every thread of it) and of its live descendants; NaN if it is gone."""
    procs = _descendants(pid)
    total = 0.0
    for p in procs:
        t = _stat_cpu(p)
        if t != t and p == pid:
            return float("nan")
        total += 0.0 if t != t else t
    return total


def _stat_cpu(pid: int) -> float:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return float("nan")
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)


def _descendants(pid: int) -> list[int]:
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                text = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            parent[int(d)] = int(text[text.rindex(")") + 2 :].split()[1])
    out, todo = [pid], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def core_busy_seconds(core: int) -> float:
    """Non-idle seconds core ``core`` has run (``/proc/stat``: all but idle and iowait)."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{core} "):
            v = [int(x) for x in line.split()[1:]]
            return (sum(v[:8]) - v[3] - v[4]) / CLK_TCK  # user..steal, less idle and iowait
    return float("nan")


def normalize(path: str) -> str:
    """A frame's file as the stage table names it (see the module docstring)."""
    if "/site-packages/" in path:
        return path.split("/site-packages/", 1)[1]
    m = _STDLIB.search(path)
    if m:
        return "stdlib/" + path[m.end() :]
    root = f"{ROOT}/"
    return path[len(root) :] if path.startswith(root) else path


def _frames(stack: str) -> list[tuple[str, str]]:
    out = []
    for f in stack.split(";"):
        m = _FRAME.match(f)
        if m:
            out.append((normalize(m["file"]), m["func"]))
    return out


def _matches(frame: tuple[str, str], prefix: str) -> bool:
    path, func = frame
    where, _, fn = prefix.partition(":")
    return path.startswith(where) and (not fn or func == fn or func.endswith("." + fn))


def stage_of(frames: list[tuple[str, str]]) -> str:
    for frame in reversed(frames):  # innermost first
        for stage, prefixes in STAGES:
            if any(_matches(frame, p) for p in prefixes):
                return stage
    return OTHER


def component_of(frames: list[tuple[str, str]]) -> str:
    for frame in frames:  # outermost first
        for comp, prefixes in COMPONENTS:
            if any(_matches(frame, p) for p in prefixes):
                return comp
    return OTHER


@dataclass
class Profile:
    samples: int = 0
    stages: Counter[str] = field(default_factory=Counter)
    components: Counter[str] = field(default_factory=Counter)
    #: (stage, component) -> samples: which thread a stage's samples came from.
    stage_components: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: the heaviest leaf frames (file:function -> samples), to look behind a stage.
    leaves: Counter[str] = field(default_factory=Counter)
    errors: str = ""
    #: CPU seconds py-spy itself used.
    profiler_cpu_s: float = float("nan")


def aggregate(raw: str) -> Profile:
    """A ``py-spy --format raw`` file's lines ("frame;frame;... count") aggregated into stages."""
    prof = Profile()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = _frames(stack)
        prof.samples += int(n)
        stage, comp = stage_of(frames), component_of(frames)
        prof.stages[stage] += int(n)
        prof.components[comp] += int(n)
        prof.stage_components[stage, comp] += int(n)
        if frames:
            prof.leaves[f"{frames[-1][0]}:{frames[-1][1]}"] += int(n)
    return prof


def py_spy() -> str | None:
    exe = Path(sys.executable).with_name("py-spy")
    return str(exe) if exe.exists() else shutil.which("py-spy")


class Profiler:
    """``py-spy record`` on ``pid`` for ``duration`` seconds, run on ``cores`` (off the target's)."""

    def __init__(
        self,
        pid: int,
        duration: float,
        rate: int = 100,
        cores: str = "",
        extra: tuple[str, ...] = (),
        keep: Path | None = None,
    ) -> None:
        #: where to keep py-spy's raw output (whole stacks, to look behind a stage), if anywhere.
        self.keep = keep
        exe = py_spy()
        if exe is None:
            raise RuntimeError("py-spy not found (pip install py-spy)")
        fd, out = tempfile.mkstemp(prefix="trainguard-bench-pyspy-", suffix=".txt")
        os.close(fd)
        self.out = Path(out)
        argv = [
            exe,
            "record",
            "--format",
            "raw",
            "--full-filenames",
            "--nolineno",
            "-o",
            out,
            "--pid",
            str(pid),
            "--duration",
            str(max(1, round(duration))),
            "--rate",
            str(rate),
            *extra,
        ]
        if cores and shutil.which("taskset"):
            argv = ["taskset", "-c", cores, *argv]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def finish(self, timeout: float = 60) -> Profile:
        try:
            _, status, usage = _wait4(self.proc.pid, timeout)
        except TimeoutError:
            self.proc.kill()
            _, status, usage = _wait4(self.proc.pid, 10)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        text = self.proc.stdout.read().decode(errors="replace") if self.proc.stdout else ""
        raw = self.out.read_text() if self.out.exists() else ""
        self.out.unlink(missing_ok=True)
        if self.keep is not None:
            self.keep.write_text(raw)
        prof = aggregate(raw)
        prof.profiler_cpu_s = usage.ru_utime + usage.ru_stime
        if self.proc.returncode or not prof.samples:
            prof.errors = text.strip()[-500:] or f"py-spy exited {self.proc.returncode}"
        return prof


def _wait4(pid: int, timeout: float) -> tuple[int, int, resource.struct_rusage]:
    """os.wait4 with a timeout (for the rusage of the child: its CPU time)."""
    deadline = time.monotonic() + timeout
    while True:
        p, status, usage = os.wait4(pid, os.WNOHANG)
        if p:
            return p, status, usage
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.1)
