"""The training reporter over a real Unix socket into the exporter's ``reporter`` source."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

from tests.exporter.conftest import make_cfg
from tests.waiting import wait_until
from trainguard.schemas.codec import decode
from trainguard.schemas.workload import LogLine, ProcessExit, TrainingStep
from trainguard.streams.exporter.sources.base import SourceContext
from trainguard.streams.exporter.sources.reporter import ReporterSource
from trainguard.streams.reporter import Reporter


def _source(root: Path, tmp_path: Path) -> ReporterSource:
    src = ReporterSource(SourceContext(make_cfg(root, tmp_path)))
    src.collect()  # binds the socket
    return src


def _collect(src: ReporterSource, n: int, timeout: float = 10.0) -> list:
    """What the source received, once it has ``n`` events."""
    got: list = []

    def enough() -> bool:
        got.extend(src.collect())
        return len(got) >= n

    wait_until(enough, timeout, lambda: f"{n} events on the reporter socket; got {got}", interval_s=0.01)
    return got


def test_steps_with_derived_metrics(root: Path, tmp_path: Path) -> None:
    src = _source(root, tmp_path)
    rep = Reporter(
        job="",
        rank=3,
        socket_path=str(src.path),
        flops_per_step=2e12,
        peak_flops=1e13,
        capture_exceptions=False,
        capture_sigterm=False,
    )
    rep.step(0, loss=5.0, tokens=4096)
    rep.step(1, loss=4.5, grad_norm=1.25, tokens=4096, step_time_s=0.5)
    rep.step(2, loss=float("nan"), tokens=8192, step_time_s=2.0)
    rep.step(3, step_time_s=0.1)  # 2e12 / 0.1 s / 1e13 = 2.0 > 1: misconfigured FLOPs -> no MFU
    rep.close(exit_code=0)
    events = _collect(src, 5)
    steps = [e for e in events if isinstance(e, TrainingStep)]
    assert [s.step for s in steps] == [0, 1, 2, 3]
    assert all(s.rank == 3 and s.node == "node-t" and s.job == "job-t" for s in steps)  # stamped by exporter
    assert steps[0].step_time_s is None and steps[0].mfu is None
    assert (steps[1].tokens_per_s, steps[1].mfu, steps[1].grad_norm) == (8192.0, 0.4, 1.25)
    assert math.isnan(steps[2].loss) and steps[2].mfu == 0.1 and steps[2].tokens_per_s == 4096.0
    assert steps[3].mfu is None
    (exit_ev,) = [e for e in events if isinstance(e, ProcessExit)]
    assert exit_ev.exit_code == 0 and exit_ev.reason == "finished"
    src.close()


def test_never_blocks_and_counts_drops_without_exporter(tmp_path: Path) -> None:
    rep = Reporter(
        job="j",
        rank=0,
        socket_path=str(tmp_path / "absent.sock"),
        queue_size=100,
        capture_exceptions=False,
        capture_sigterm=False,
        flush_interval_s=10,
    )
    t0 = time.perf_counter()
    for i in range(1000):
        rep.step(i, loss=1.0)
    per_step_us = (time.perf_counter() - t0) / 1000 * 1e6
    assert rep.dropped == 900  # queue full: dropped and counted, not blocked
    rep.flush()
    assert rep.dropped == 1000 and rep.sent == 0  # no exporter: every send counted as a drop
    rep.close()
    assert per_step_us < 200  # generous for a loaded CI box; the bench measures the real number


def test_dropped_count_travels_with_the_next_step(root: Path, tmp_path: Path) -> None:
    src = _source(root, tmp_path)
    rep = Reporter(
        job="job-t",  # the exporter's job: a claim of another is refused
        rank=0,
        socket_path=str(src.path),
        queue_size=2,
        flush_interval_s=10,
        capture_exceptions=False,
        capture_sigterm=False,
    )
    for i in range(5):
        rep.step(i)
    rep.flush()
    rep.step(5)
    rep.close()
    steps = [e for e in _collect(src, 4) if isinstance(e, TrainingStep)]
    assert [(s.step, s.dropped) for s in steps] == [(0, 3), (1, 0), (5, 0)]
    src.close()


CRASHING = """
import threading
from trainguard.streams.reporter import Reporter
rep = Reporter(job="job-t", rank=1, socket_path={sock!r})
rep.step(0, loss=1.0)
t = threading.Thread(target=lambda: 1 / 0, name="prefetch")
t.start(); t.join()
def load_batch(i):
    raise IndexError(f"batch {{i}} out of range")
load_batch(7)
"""


def test_uncaught_exception_is_reported_with_traceback(root: Path, tmp_path: Path) -> None:
    src = _source(root, tmp_path)
    res = subprocess.run(
        [sys.executable, "-c", CRASHING.format(sock=str(src.path))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1 and "IndexError" in res.stderr  # the original hook still prints
    events = _collect(src, 3)
    (exit_ev,) = [e for e in events if isinstance(e, ProcessExit)]
    assert exit_ev.exit_code == 1 and exit_ev.rank == 1
    assert exit_ev.reason == "uncaught IndexError: batch 7 out of range"
    assert "load_batch" in exit_ev.traceback and exit_ev.traceback.rstrip().endswith(
        "IndexError: batch 7 out of range"
    )
    (thread_log,) = [e for e in events if isinstance(e, LogLine)]
    assert "prefetch" in thread_log.line and "ZeroDivisionError" in thread_log.line
    src.close()


def test_sigterm_reports_signal(root: Path, tmp_path: Path) -> None:
    src = _source(root, tmp_path)
    code = (
        "import time; from trainguard.streams.reporter import Reporter; "
        f"r = Reporter(job='job-t', rank=2, socket_path={str(src.path)!r}); print('up', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        proc.terminate()
        assert proc.wait(30) == -15  # still dies of SIGTERM
    finally:
        proc.kill()
        proc.wait()
    (exit_ev,) = [e for e in _collect(src, 1) if isinstance(e, ProcessExit)]
    assert (exit_ev.signal, exit_ev.reason, exit_ev.rank) == (15, "SIGTERM", 2)
    src.close()


def test_garbage_datagrams_are_rejected_not_published(root: Path, tmp_path: Path) -> None:
    import socket

    src = _source(root, tmp_path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.sendto(b"\xff\x00 not json", str(src.path))
    s.sendto(
        b'{"schema": "heartbeat", "version": 1, "node": "x", "component": "c", "ts_ms": 1}', str(src.path)
    )
    s.close()
    published: list = []

    def both_rejected() -> bool:
        published.extend(src.collect())
        return src.rejected == 2

    wait_until(both_rejected, 10, lambda: f"2 datagrams rejected; rejected {src.rejected}", interval_s=0.01)
    assert published == [] and src.rejected == 2
    src.close()


def test_data_wait_travels_and_older_steps_still_decode(root: Path, tmp_path: Path) -> None:
    src = _source(root, tmp_path)
    rep = Reporter(job="", rank=0, socket_path=str(src.path), capture_exceptions=False, capture_sigterm=False)
    rep.step(0, step_time_s=0.5, data_wait_s=0.125)
    rep.step(1, step_time_s=0.5)
    rep.close(exit_code=0)
    steps = [e for e in _collect(src, 3) if isinstance(e, TrainingStep)]
    assert [(s.step, s.data_wait_s) for s in steps] == [(0, 0.125), (1, None)]
    # A step from a reporter that predates the field decodes, without it.
    old = (
        b'{"schema":"training_step","version":1,"job":"j","rank":0,"step":5,"ts_ms":1000,"node":"",'
        b'"loss":null,"grad_norm":null,"step_time_s":0.5,"tokens":null,"tokens_per_s":null,"mfu":null,'
        b'"dropped":0}'
    )
    assert decode(old).data_wait_s is None


def test_log_lines_go_now_with_the_ranks_job_and_a_sequence(root: Path, tmp_path: Path) -> None:
    src = _source(root, tmp_path)
    rep = Reporter(job="job-t", rank=3, node="n7", socket_path=str(src.path), capture_exceptions=False,
                   capture_sigterm=False, flight_recorder=False)  # fmt: skip
    line = "trainguard shadow loader: took over from loader 1 (stalled: no batch for 1.02 s, ...)"
    assert rep.log(line) and rep.log("second")
    logs = [e for e in _collect(src, 2) if isinstance(e, LogLine)]
    # The rank says it is on "n7"; it runs on this exporter's node, whose name the lines carry.
    assert [(e.job, e.rank, e.node, e.source, e.line, e.seq) for e in logs] == [
        ("job-t", 3, "node-t", "trainguard", line, 1),
        ("job-t", 3, "node-t", "trainguard", "second", 2),
    ]
    rep.close(exit_code=0)
    src.close()
    gone = Reporter(job="j", rank=0, socket_path=str(tmp_path / "absent.sock"), capture_exceptions=False,
                    capture_sigterm=False, flight_recorder=False)  # fmt: skip
    assert gone.log("nobody listens") is False  # never raises
    gone.close()
