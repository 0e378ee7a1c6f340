"""Training-reporter overhead per ``step()`` call: the cost a training loop pays.

    .venv/bin/python bench/reporter_bench.py [--steps 200000]

A paced loop (one step per millisecond, faster than any real training step) against a live
exporter socket, then floods (back-to-back calls): (1) a live exporter socket drained by the
exporter's reporter source in another process,
(2) no exporter at all (every send fails and is counted), (3) a full queue (the drop path).
Prints mean / p50 / p99 / max microseconds per call (each call timed with perf_counter_ns, which
adds ~0.1 us) and the mean over an untimed loop.  Target: < 50 us, never blocking.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainguard.streams.exporter.config import load_exporter_config
from trainguard.streams.exporter.sources.base import SourceContext
from trainguard.streams.exporter.sources.reporter import ReporterSource
from trainguard.streams.reporter import Reporter


def run(rep: Reporter, steps: int) -> tuple[list[float], float]:
    lat = []
    for i in range(steps):
        t = time.perf_counter_ns()
        rep.step(i, loss=2.0, grad_norm=1.0, tokens=4096)
        lat.append((time.perf_counter_ns() - t) / 1000)
    t0 = time.perf_counter()
    for i in range(steps):
        rep.step(i, loss=2.0, grad_norm=1.0, tokens=4096)
    return lat, (time.perf_counter() - t0) / steps * 1e6


def report(name: str, lat: list[float], untimed: float, rep: Reporter) -> None:
    q = statistics.quantiles(lat, n=100)
    print(
        f"{name:<22} mean {statistics.fmean(lat):6.2f} us  p50 {q[49]:6.2f}  p99 {q[98]:6.2f}  "
        f"max {max(lat):8.1f}  untimed mean {untimed:5.2f} us   sent {rep.sent} dropped {rep.dropped}"
    )


def exporter_side(path: str, conn: Connection) -> None:
    """The exporter's reporter source in its own process, as in production."""
    cfg = load_exporter_config(
        {"node": "b", "reporter": {"socket": path, "max_per_round": 10_000_000}}, environ={}
    )
    src = ReporterSource(SourceContext(cfg))
    src.collect()
    conn.send("ready")
    received = 0
    while not conn.poll(0.05):
        received += len(src.collect())
    time.sleep(0.3)
    received += len(src.collect())
    conn.send(received)
    src.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--paced-steps", type=int, default=3000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="reporter-bench-"))
    path = str(tmp / "r.sock")
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.get_context("fork").Process(target=exporter_side, args=(path, child))
    proc.start()
    assert parent.recv() == "ready"
    kw = {"capture_exceptions": False, "capture_sigterm": False, "queue_size": 1_000_000}
    rep = Reporter(job="bench", rank=0, socket_path=path, **kw)  # type: ignore[arg-type]
    paced = []
    for i in range(args.paced_steps):  # a fast but real loop: one step per millisecond
        t = time.perf_counter_ns()
        rep.step(i, loss=2.0, grad_norm=1.0, tokens=4096)
        paced.append((time.perf_counter_ns() - t) / 1000)
        time.sleep(0.001)
    lat, untimed = run(rep, args.steps)
    rep.close()
    parent.send("stop")
    received = parent.recv()
    proc.join()
    q = statistics.quantiles(paced, n=100)
    print(
        f"{'paced 1 kHz, live':<22} mean {statistics.fmean(paced):6.2f} us  "
        f"p50 {q[49]:6.2f}  p99 {q[98]:6.2f}  "
        f"max {max(paced):8.1f}  ({args.paced_steps} steps)"
    )
    report("flood, live exporter", lat, untimed, rep)
    print(f"{'':<22} exporter process received {received} events")
    rep = Reporter(job="bench", rank=0, socket_path=str(tmp / "absent.sock"), **kw)  # type: ignore[arg-type]
    lat, untimed = run(rep, args.steps)
    rep.close()
    report("flood, no exporter", lat, untimed, rep)
    kw["queue_size"] = 16
    rep = Reporter(job="bench", rank=0, socket_path=str(tmp / "absent.sock"), flush_interval_s=3600, **kw)  # type: ignore[arg-type]
    lat, untimed = run(rep, args.steps)
    report("flood, queue full", lat, untimed, rep)
    rep.close()


if __name__ == "__main__":
    main()
