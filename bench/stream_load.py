"""Benchmark: how many machines one stream worker (one core) keeps up with, and Xid->decision latency.

Simulates N machines x 8 GPUs at ByteRobust's default intervals (GPU and host samples every
10 s, NIC every 30 s, exporter heartbeat every 5 s) plus step telemetry of 8 ranks per machine
(one step every --step-interval seconds), against the running local stack.  A real
`trainguard worker` is started pinned to one core (taskset), consuming from "latest".  Every 2 s
an Xid 79 line for a fresh node is produced, after that second's samples are all in Kafka and by
a producer of its own (as a node's exporter sends it, not queued behind every other machine's
samples in the generator's one client); its latency is the time until the evict decision
arrives on the decisions topic, split into hops by the records' CreateTimes (the line to its
detection being sent, that to the decision being sent, that to this bench seeing it).  The
worker "keeps up" when its consumer lag (from its /metrics) stays bounded: the lag at the end is
below 2 s worth of input.

Cost, not only keep-up (a shared machine makes "keeps up" depend on what else runs): over the
measured window (from --warmup seconds into the load to the end of a 3 s drain) the worker's own
CPU time (``/proc/<pid>/stat`` utime+stime: all its threads) per 1,000 input messages it consumed
(those sent less what its consumer lag grew by), and the load generator's (this process: its
producer, watcher and /metrics polling threads) per 1,000 sent.  The generator and py-spy run on
the other cores (sched_setaffinity), never on the worker's; the output says which, and how much
of the worker's core other processes took in the window ("others on core").  With ``--profile``
(the default) ``py-spy record --gil`` samples the worker during the window -- a sample is the
thread holding the GIL, so samples / rate tracks its CPU time, printed as a check -- and the
samples are split into stages by the innermost frame matching the table in
``bench/worker_cost.py``: each stage's share of the samples, and that share of the worker's CPU
per 1,000 messages.  ``--json`` prints one object (the levels, their cost and profiles) on stdout
and the tables on stderr.  The worker's CPU is also given per 1,000 events its agents processed
(``trainguard_agent_events_total`` from its /metrics, the sink's own count left out): the lag
gauge is refreshed every 5 s, so at loads the worker does not keep up with "sent less what the
lag grew by" miscounts what it consumed.  The agents read every topic but the exporters'
heartbeats (the sink's alone, 16 % of the messages sent here), so at a load kept up with the
processed events are about 84 % of those sent.

``--workers 1,2,4``: at every level, that many workers with the same app id share the partitions,
all pinned to the worker core (this machine has two cores and the generator needs the other): the
run measures what splitting the partitions costs (each worker's CPU, all of them per 1,000
messages), and the table projects N workers on N cores of their own from it: the load could grow
until the busiest worker filled its core (partitions do not split evenly: one job's steps all go
to one worker).  The profile samples the first worker only.

``--burst``: every machine's GPU batch is sent in the same second, every 10 s (10 s sampling that
aligns across machines), instead of spread over the 10 s; the Xid line sent in that second, right
after the burst, is reported apart.

``--sink-process``: the worker runs with ``worker.sink_process: true`` and a ``trainguard sink``
(same app id, so the same sink group) runs beside it on the generator's cores: the worker's CPU
is then the detection path's alone, and the sink's CPU per 1,000 messages and its lag at the end
are reported apart.

    python bench/stream_load.py --machines 300,600,1200 [--seconds 60] [--step-interval 10]
                                [--warmup 5] [--no-profile] [--json] [--worker-core 1]
                                [--sink-process] [--workers 1,2,4] [--burst]
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from decode_cost import gpu_samples
from worker_cost import STAGES, Profile, Profiler, core_busy_seconds, cpu_seconds

from trainguard.infra.config import load_settings
from trainguard.infra.progress import Progress
from trainguard.schemas.base import now_ms
from trainguard.schemas.codec import decode, encode
from trainguard.schemas.control import Decision, Detection
from trainguard.schemas.telemetry import (
    DiskUsage,
    GpuSampleBatch,
    Heartbeat,
    HostSample,
    NicSample,
    NicSampleBatch,
    SourceHealth,
)
from trainguard.schemas.topics import DECISIONS, DETECTIONS, GPU, HEARTBEATS, HOST, LOGS, NIC, STEPS
from trainguard.schemas.workload import LogLine, TrainingStep

XID = "[ 8123.456789] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."


def _metrics(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return str(r.read().decode())
    except OSError:
        return None


def _sum(text: str | None, pattern: str) -> float:
    """The sum of the samples ``pattern`` matches in a /metrics text; NaN without a text."""
    if text is None:
        return float("nan")
    return sum(float(m) for m in re.findall(pattern, text, re.M))


def lag_of(port: int, metric: str = "trainguard_consumer_lag", text: str | None = None) -> float:
    """The sum of ``metric`` over its labels, from ``text`` or else a fresh read of /metrics."""
    return _sum(text if text is not None else _metrics(port), rf"^{metric}\{{[^}}]*\}} (\S+)$")


def processed_of(text: str | None) -> float:
    """Events the worker's agents processed (the sink's own count, ``agent="sink"``, left out)."""
    return _sum(text, r'^trainguard_agent_events_total\{agent="(?!sink")[^"]*"\} (\S+)$')


#: the workers and sinks this bench started: stopped at exit, also when it is interrupted.
_STARTED: list[subprocess.Popen[bytes]] = []


def _stop_started() -> None:
    for proc in _STARTED:
        if proc.poll() is None:
            proc.kill()


atexit.register(_stop_started)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # atexit runs on SystemExit, not on a signal


def _port_free(port: int) -> None:
    """Refuse a port something already answers on (a worker left over from an interrupted run would
    answer /metrics for ours, and its numbers would be taken for the new worker's)."""
    if _metrics(port) is not None:
        raise RuntimeError(f"port {port} already serves /metrics: stop what runs there (ss -ltnp) first")


def _popen(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    _STARTED.append(proc)
    return proc


def start_worker(
    port: int, log: Path, core: int | None, app_id: str, sink_process: bool = False
) -> subprocess.Popen[bytes]:
    _port_free(port)
    exe = str(Path(sys.executable).with_name("trainguard"))
    argv = [exe, "worker", "--app-id", app_id, "--web-port", str(port), "--loglevel", "error"]
    if core is not None:
        argv = ["taskset", "-c", str(core), *argv]  # taskset execs: the pid is the worker's
    env = {**os.environ, "TRAINGUARD__WORKER__AUTO_OFFSET_RESET": "latest"}
    if sink_process:
        env["TRAINGUARD__WORKER__SINK_PROCESS"] = "true"
    proc = _popen(argv, log, env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if lag_of(port) == lag_of(port):  # not NaN: the web server answers
            time.sleep(8)  # group join + partition assignment
            return proc
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"worker did not start; see {log}")


def start_sink(port: int, log: Path, cores: str, app_id: str) -> subprocess.Popen[bytes]:
    """``trainguard sink`` for the worker's app id, on ``cores`` (the generator's), /metrics on ``port``."""
    exe = str(Path(sys.executable).with_name("trainguard"))
    argv = ["taskset", "-c", cores, exe, "sink", "--app-id", app_id, "--web-port", str(port)]
    env = {**os.environ, "TRAINGUARD__WORKER__AUTO_OFFSET_RESET": "latest"}
    _port_free(port)
    proc = _popen(argv, log, env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _metrics(port) is not None:
            return proc
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"sink did not start; see {log}")


def run(
    machines: int,
    seconds: float,
    step_interval: float,
    port: int,
    core: int | None,
    others: str,
    profile: bool,
    rate: int,
    warmup: float,
    raw_dir: Path | None = None,
    sink_process: bool = False,
    workers: int = 1,
    burst: bool = False,
) -> dict[str, Any]:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    settings = load_settings()
    job = f"bench-{uuid.uuid4().hex[:6]}"
    nodes = [f"{job}-n{i:05d}" for i in range(machines)]
    log = Path(f"/tmp/trainguard-bench-worker-{machines}.log")
    app_id = f"bench-{uuid.uuid4().hex[:6]}"
    sink = (
        start_sink(port + workers, Path(f"/tmp/trainguard-bench-sink-{machines}.log"), others, app_id)
        if sink_process
        else None
    )
    ports = [port + i for i in range(workers)]
    # One at a time: each joins the group and gets its share of the partitions before the next.
    procs = [
        start_worker(p, log.with_suffix(f".{i}.log") if i else log, core, app_id, sink_process)
        for i, p in enumerate(ports)
    ]
    if workers > 1:
        time.sleep(8)  # the last join's rebalance settles before the load starts
    worker, pids = procs[0], [w.pid for w in procs]
    sink_pid = sink.pid if sink is not None else None
    producer = KafkaProducer(**settings.kafka.client_kwargs(), linger_ms=20, compression_type="gzip", acks=1)
    # The Xid lines come from a client of their own, as they do from their node's exporter: one
    # client for every machine's samples would queue each line behind a second's worth of them.
    xid_producer = KafkaProducer(**settings.kafka.client_kwargs(), acks=1)
    injected: dict[str, float] = {}
    latencies: list[float] = []
    #: the Xid lines sent right after a burst (--burst), and their latencies.
    after_burst: set[str] = set()
    burst_latencies: list[float] = []
    #: node -> the detection's CreateTime (s): when the worker's inspection agent sent it.
    detected_at: dict[str, float] = {}
    #: per Xid: (line sent -> detection sent, detection sent -> decision sent, decision sent -> seen)
    hops: list[tuple[float, float, float]] = []
    stop = threading.Event()

    def watch() -> None:
        c = KafkaConsumer(**settings.kafka.client_kwargs(), group_id=None)
        parts = [TopicPartition(t.name, p) for t in (DECISIONS, DETECTIONS) for p in range(t.partitions)]
        c.assign(parts)
        c.seek_to_end(*parts)
        while not stop.is_set():
            for recs in c.poll(timeout_ms=200).values():
                for r in recs:
                    d = decode(r.value)
                    if isinstance(d, Detection) and d.job == job and d.node in injected:
                        detected_at.setdefault(d.node, r.timestamp / 1000)
                    if isinstance(d, Decision) and d.job == job:
                        seen = time.time()
                        for m in d.targets.machines:
                            if m in injected:
                                sent = injected.pop(m)
                                latencies.append(seen - sent)
                                if m in after_burst:
                                    burst_latencies.append(seen - sent)
                                det = detected_at.pop(m, math.nan)
                                decided = r.timestamp / 1000
                                hops.append((det - sent, decided - det, seen - decided))
        c.close()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(1)
    per_s = machines * (1 / 10 + 1 / 10 + 1 / 30 + 1 / 5 + 8 / step_interval)
    gpus = gpu_samples()
    drain_s = 3.0
    t_start = time.monotonic()
    win: Mark | None = None  # the measured window starts after the warm-up ...
    prof: Profiler | None = None
    tick = 0
    lags = []
    sent = 0
    xids = 0
    while time.monotonic() - t_start < seconds:
        t_tick = time.monotonic()
        if win is None and t_tick - t_start >= warmup:
            win = mark(pids, core, sent + xids, ports, sink_pid)
            if profile:
                keep = raw_dir / f"pyspy-{machines}.txt" if raw_dir else None
                prof = Profiler(worker.pid, seconds - warmup + drain_s, rate, others, ("--gil",), keep)
        ts = now_ms()
        for i, node in enumerate(nodes):  # spread each source over its interval, 1 s ticks
            # --burst: every machine's GPU batch in the same second, as aligned 10 s sampling sends them
            if (tick % 10 == 0) if burst else (i % 10 == tick % 10):
                producer.send(
                    GPU.name,
                    key=node.encode(),
                    value=encode(GpuSampleBatch(node=node, ts_ms=ts, gpus=gpus, job=job)),
                )
                sent += 1
            if i % 10 == tick % 10:
                producer.send(
                    HOST.name,
                    key=node.encode(),
                    value=encode(
                        HostSample(
                            node=node,
                            ts_ms=ts,
                            cpu_util_pct=40.0,
                            load1=8,
                            load5=8,
                            load15=8,
                            mem_total_bytes=2 << 40,
                            mem_available_bytes=1 << 40,
                            disks=[DiskUsage("/", 10**12, 10**11)],
                            job=job,
                        )
                    ),
                )
                sent += 1
            if i % 30 == tick % 30:
                producer.send(
                    NIC.name,
                    key=node.encode(),
                    value=encode(
                        NicSampleBatch(
                            node=node,
                            ts_ms=ts,
                            job=job,
                            nics=[NicSample(name="ib0", kind="ib", operstate="up", carrier=True)],
                        )
                    ),
                )
                sent += 1
            if i % 5 == tick % 5:
                producer.send(
                    HEARTBEATS.name,
                    key=node.encode(),
                    value=encode(
                        Heartbeat(
                            node=node,
                            component="exporter",
                            ts_ms=ts,
                            job=job,
                            sources=[SourceHealth("nvml", True, ts)],
                        )
                    ),
                )
                sent += 1
            if i % int(step_interval) == tick % int(step_interval):
                for r in range(8):
                    producer.send(
                        STEPS.name,
                        key=job.encode(),
                        value=encode(
                            TrainingStep(
                                job=job,
                                rank=i * 8 + r,
                                step=tick,
                                ts_ms=ts,
                                node=node,
                                loss=2.0,
                                grad_norm=1.0,
                                step_time_s=step_interval,
                            )
                        ),
                    )
                sent += 8
        producer.flush()  # the second's telemetry is in Kafka, ahead of the Xid line
        if tick % 2 == 0:
            node = f"{job}-xid{tick}"
            if burst and tick % 10 == 0:
                after_burst.add(node)
            injected[node] = time.time()
            xid_producer.send(
                LOGS.name,
                key=node.encode(),
                value=encode(
                    LogLine(node=node, ts_ms=now_ms(), source="kernel", line=XID, seq=tick, job=job)
                ),
            )
            xid_producer.flush()
            xids += 1
        lags.append(sum(lag_of(p) for p in ports))
        tick += 1
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t_tick)))
    time.sleep(drain_s)  # ... and ends after the drain
    end = mark(pids, core, sent + xids, ports, sink_pid)
    sink_lag = lag_of(port + workers, "trainguard_sink_lag") if sink is not None else float("nan")
    stop.set()
    watcher.join(5)
    profiled = prof.finish() if prof else None
    for w in procs:
        w.terminate()
    for w in procs:
        w.wait(20)
    if sink is not None:
        sink.terminate()
        sink.wait(30)
    producer.close()
    xid_producer.close()
    lat = sorted(latencies)
    final_lag = end.lag
    cost = window_cost(win or end, end)
    return {
        "machines": machines,
        "msgs_per_s": per_s,
        "sent": sent,
        "final_lag": final_lag,
        "max_lag": max(lags) if lags else float("nan"),
        "keeps_up": float(final_lag < 2 * per_s),
        "xid_p50_s": statistics.median(lat) if lat else float("nan"),
        "xid_p99_s": p99(lat),
        "xid_lost": len(injected),
        "workers": workers,
        "burst": burst,
        # --burst: the Xid lines sent in the same second as every machine's GPU batch
        "xid_after_burst_p50_s": statistics.median(burst_latencies) if burst_latencies else math.nan,
        "xid_after_burst_max_s": max(burst_latencies) if burst_latencies else math.nan,
        "xid_after_burst_n": len(burst_latencies),
        # where an Xid's time went (record CreateTimes; p50 and p99 of each hop)
        "xid_hops_s": hop_quantiles(hops),
        "sink_process": sink_process,
        "sink_final_lag": sink_lag,
        **cost,
        "profile": profile_dict(profiled, cost, rate) if profiled else None,
    }


def p99(xs: list[float]) -> float:
    """The 99th percentile of ``xs`` (sorted), nearest rank; NaN for none."""
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else math.nan


def hop_quantiles(hops: list[tuple[float, float, float]]) -> dict[str, dict[str, float]]:
    """p50 and p99 of each hop of the Xid path: the line to its detection being sent (the
    inspection agent), the detection to the decision being sent (the decide agent), the decision
    to this bench seeing it."""
    out = {}
    for i, name in enumerate(("line_to_detection", "detection_to_decision", "decision_to_seen")):
        xs = sorted(h[i] for h in hops if not math.isnan(h[i]))
        out[name] = {
            "p50": statistics.median(xs) if xs else math.nan,
            "p99": p99(xs),
        }
    return out


@dataclass(frozen=True)
class Mark:
    """The counters at one end of the measured window."""

    t: float
    worker_cpu_s: float
    generator_cpu_s: float
    #: busy seconds of the worker's core (all processes); NaN when the worker is not pinned.
    core_busy_s: float
    produced: int
    lag: float
    #: events the worker's agents processed so far (its /metrics).
    processed: float
    #: the ``trainguard sink`` process's CPU seconds; NaN without one.
    sink_cpu_s: float
    #: each worker's CPU seconds (``worker_cpu_s`` is their sum).
    per_worker_cpu_s: tuple[float, ...] = ()


def mark(
    pids: list[int], core: int | None, produced: int, ports: list[int], sink_pid: int | None = None
) -> Mark:
    """The counters now; the workers' (``pids``, /metrics on ``ports``) summed over the workers."""
    texts = [_metrics(port) for port in ports]  # one read each for the lag and the processed count
    cpus = tuple(cpu_seconds(pid) for pid in pids)
    return Mark(
        time.monotonic(),
        sum(cpus),
        time.process_time(),  # this process, all its threads: producer, watcher, lag polling
        core_busy_seconds(core) if core is not None else math.nan,
        produced,
        sum(lag_of(port, text=text) for port, text in zip(ports, texts, strict=True)),
        sum(processed_of(text) for text in texts),
        cpu_seconds(sink_pid) if sink_pid is not None else math.nan,
        cpus,
    )


def window_cost(a: Mark, b: Mark) -> dict[str, Any]:
    """CPU over the window: the worker's per 1,000 messages it consumed, the generator's per 1,000 sent."""
    wall = b.t - a.t
    produced = b.produced - a.produced
    grew = b.lag - a.lag if not (math.isnan(a.lag) or math.isnan(b.lag)) else 0.0
    consumed = max(1.0, produced - max(0.0, grew))  # input less what the consumer's lag grew by
    cpu, gen = b.worker_cpu_s - a.worker_cpu_s, b.generator_cpu_s - a.generator_cpu_s
    processed = b.processed - a.processed
    sink_cpu = b.sink_cpu_s - a.sink_cpu_s
    return {
        "window_s": wall,
        "produced": produced,
        "consumed": consumed,
        "worker_cpu_s": cpu,
        "worker_core_util_pct": 100 * cpu / wall,
        "worker_cpu_ms_per_1k": 1e6 * cpu / consumed,
        "processed": processed,
        # NaN when the /metrics could not be read at either end
        "worker_cpu_ms_per_1k_processed": 1e6 * cpu / processed if processed > 0 else math.nan,
        "sink_cpu_s": sink_cpu,
        "per_worker_cpu_s": [y - x for x, y in zip(a.per_worker_cpu_s, b.per_worker_cpu_s, strict=True)],
        "sink_cpu_ms_per_1k": 1e6 * sink_cpu / consumed,
        "generator_cpu_s": gen,
        "generator_cpu_ms_per_1k": 1e6 * gen / max(1, produced),
        # what else ran on the worker's core (its busy time less the worker's own CPU)
        "worker_core_others_pct": 100 * max(0.0, b.core_busy_s - a.core_busy_s - cpu) / wall,
    }


def profile_dict(p: Profile, cost: dict[str, float], rate: int) -> dict[str, Any]:
    """Per stage: samples, share of them, and that share of the worker's CPU per 1,000 messages.

    py-spy runs with ``--gil``: a sample is the thread holding the GIL, so samples / rate is the
    worker's Python CPU time; ``gil_coverage_pct`` says how much of the measured CPU that is (the
    rest: syscalls and C code that releases the GIL, zlib for one, spread over the stages here)."""
    if not p.samples:
        return {"samples": 0, "profiler_cpu_s": p.profiler_cpu_s, "errors": p.errors, "stages": {}}
    ms_per_1k, total = cost["worker_cpu_ms_per_1k"], p.samples
    stages = {}
    for name, n in p.stages.most_common():
        threads = {c: k for (st, c), k in p.stage_components.most_common() if st == name}
        stages[name] = {
            "samples": n,
            "pct": 100 * n / total,
            "cpu_ms_per_1k": ms_per_1k * n / total,
            "threads_pct": {c: 100 * k / n for c, k in threads.items()},
        }
    return {
        "samples": total,
        "gil_coverage_pct": 100 * total / rate / cost["worker_cpu_s"] if cost["worker_cpu_s"] else None,
        "profiler_cpu_s": p.profiler_cpu_s,
        "errors": p.errors,
        "stages": stages,
        "threads_pct": {k: 100 * n / total for k, n in p.components.most_common()},
        "top_leaves_pct": {k: 100 * n / total for k, n in p.leaves.most_common(15)},
    }


def cores(worker_core: int) -> tuple[int | None, str]:
    """(the worker's core or None, the other cores as a taskset list); pins this process there."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2 or worker_core not in allowed or not shutil.which("taskset"):
        return None, ",".join(map(str, allowed))
    others = [c for c in allowed if c != worker_core]
    os.sched_setaffinity(0, others)  # before any thread starts: the producer's and watcher's too
    return worker_core, ",".join(map(str, others))


def _level(
    args: argparse.Namespace, n: int, k: int, core: int | None, others: str, bar: Progress, out: TextIO
) -> dict[str, Any]:
    """One level (``n`` machines, ``k`` workers): run, its table row printed."""
    r = run(
        n,
        args.seconds,
        args.step_interval,
        args.web_port,
        core,
        others,
        args.profile,
        args.profile_rate,
        args.warmup,
        args.profile_raw,
        args.sink_process,
        k,
        args.burst,
    )
    bar.advance()
    bar.echo(
        f"{n:8d}  {k:7d}  {r['msgs_per_s']:11.0f}  {'yes' if r['keeps_up'] else 'NO':8}"
        f"  {r['final_lag']:9.0f}  "
        f"{r['max_lag']:7.0f}  {r['xid_p50_s']:17.2f}s {r['xid_p99_s']:5.2f}s  {r['xid_lost']:13d}"
        f"  {r['worker_cpu_ms_per_1k']:21.0f}  {r['worker_cpu_ms_per_1k_processed']:15.0f}"
        f"  {r['worker_core_util_pct']:8.0f}%  {r['worker_core_others_pct']:13.0f}%"
        f"  {r['generator_cpu_ms_per_1k']:19.0f}"
        + (f"  {r['sink_cpu_ms_per_1k']:14.0f}  {r['sink_final_lag']:8.0f}" if args.sink_process else ""),
        file=out,
    )
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machines", default="300,600,1200")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--step-interval", type=float, default=10)
    ap.add_argument("--web-port", type=int, default=16300)
    ap.add_argument(
        "--warmup",
        type=float,
        default=5,
        help="seconds of load before the CPU/profile window starts (lazy imports, first inserts)",
    )
    ap.add_argument("--worker-core", type=int, default=1, help="core the worker is pinned to (default 1)")
    ap.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sample the worker with py-spy and split its CPU into stages (default on)",
    )
    ap.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument(
        "--profile-raw",
        type=Path,
        default=None,
        help="keep py-spy's raw stacks here (pyspy-<machines>.txt), to look behind a stage",
    )
    ap.add_argument(
        "--sink-process",
        action="store_true",
        help="the worker runs no sink (worker.sink_process); `trainguard sink` runs on the generator's cores",
    )
    ap.add_argument(
        "--workers",
        default="1",
        help="workers sharing the partitions (same app id), all on --worker-core; a list runs each "
        "count at every level and prints what splitting the partitions costs (default 1)",
    )
    ap.add_argument(
        "--burst",
        action="store_true",
        help="every machine's GPU batch in the same second, every 10 s (aligned sampling), instead of "
        "spread over the 10 s; the Xid line of that second is reported apart",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    args = ap.parse_args()
    worker_counts = [int(x) for x in args.workers.split(",")]
    if min(worker_counts) < 1:
        ap.error("--workers must be 1 or more")
    if not 0 <= args.warmup < args.seconds:
        ap.error("--warmup must be shorter than --seconds")
    core, others = cores(args.worker_core)
    out = sys.stderr if args.json else sys.stdout
    where = f"core {core} (taskset)" if core is not None else "not pinned (fewer than 2 cores or no taskset)"
    print(
        f"worker: {where}; load generator{' and py-spy' if args.profile else ''}: cores {others}; "
        f"{args.seconds:g} s per level + 3 s drain"
        + ("; the sink: a `trainguard sink` process on the generator's cores" if args.sink_process else ""),
        file=out,
    )
    print(
        "machines  workers  input msg/s  keeps_up  final_lag  max_lag"
        "  xid->decision p50   p99   (not decided)"
        "  worker CPU ms/1k msgs  (/1k processed)  core util  others on core  generator CPU ms/1k"
        + ("  sink CPU ms/1k  sink lag" if args.sink_process else ""),
        file=out,
        flush=True,
    )
    results = []
    levels = [(n, k) for n in [int(x) for x in args.machines.split(",")] for k in worker_counts]
    # On stderr, a thread of this process: what it costs the generator's CPU figure is noise
    # (a few microseconds a second against the generator's hundreds of milliseconds).
    bar = Progress("stream load", total=len(levels), unit="levels")
    with bar, bar.ticking():
        for n, k in levels:
            bar.update(detail=f"{n} machines, {k} worker(s): {args.seconds:g} s of load")
            results.append(_level(args, n, k, core, others, bar, out))
    print(
        "\nwhere an Xid's time went (p50 / p99 s): line -> detection sent, -> decision sent, -> seen here",
        file=out,
    )
    for r in results:
        h = r["xid_hops_s"]
        print(
            f"{r['machines']:8d}  {r['workers']:7d}  "
            + "  ".join(f"{h[k]['p50']:5.2f} / {h[k]['p99']:5.2f}" for k in h),
            file=out,
        )
    if args.burst:
        print("\nthe Xid line sent in a burst's second: n, p50, max (s)", file=out)
        for r in results:
            print(
                f"{r['machines']:8d}  {r['workers']:7d}  {r['xid_after_burst_n']:3d}  "
                f"{r['xid_after_burst_p50_s']:5.2f}  {r['xid_after_burst_max_s']:5.2f}",
                file=out,
            )
    if len(worker_counts) > 1:
        print_scaling(results, out)
    if args.profile:
        print_profiles(results, out)
    if args.json:
        print(
            json.dumps(
                strict_json(
                    {
                        "worker_core": core,
                        "generator_cores": others,
                        "seconds": args.seconds,
                        "step_interval": args.step_interval,
                        "profile": args.profile,
                        "profile_rate": args.profile_rate,
                        "levels": results,
                        "scaling": scaling(results) if len(worker_counts) > 1 else None,
                        "burst": args.burst,
                        "warmup_s": args.warmup,
                        "sink_process": args.sink_process,
                    }
                )
            )
        )


def strict_json(v: Any) -> Any:
    """NaN (a lag that could not be read, no latency measured) as null: strict JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: strict_json(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [strict_json(x) for x in v]
    return v


def scaling(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per level and worker count: what N workers, each on a core of its own, would keep up with,
    projected from the measured CPU: the load grows until the busiest worker fills its core
    (machines x window / the busiest worker's CPU seconds).  Partitions do not split evenly: a
    job's steps are keyed by the job, so one worker reads all of a job's steps.  The scaling
    factor is that projection over the one-worker run's."""
    out = []
    bound = {}
    for r in results:
        busiest = max(r["per_worker_cpu_s"], default=0.0)
        bound[id(r)] = r["machines"] * r["window_s"] / busiest if busiest > 0 else math.nan
    single = {r["machines"]: bound[id(r)] for r in results if r["workers"] == 1}
    for r in results:
        cpus = r["per_worker_cpu_s"]
        total = sum(cpus)
        out.append(
            {
                "machines": r["machines"],
                "workers": r["workers"],
                "keeps_up": r["keeps_up"],
                "per_worker_cpu_s": cpus,
                "cpu_ms_per_1k": r["worker_cpu_ms_per_1k"],
                "busiest_worker_share_pct": 100 * max(cpus) / total if total > 0 else math.nan,
                "projected_machines_total": bound[id(r)],
                "projected_machines_per_worker": bound[id(r)] / r["workers"],
                "projected_scaling_factor": bound[id(r)] / single[r["machines"]]
                if r["machines"] in single
                else math.nan,
            }
        )
    return out


def print_scaling(results: list[dict[str, Any]], out: Any) -> None:
    print(
        "\nworkers sharing the partitions (all on the worker core here; projected: each on a core of "
        "its own, until the busiest fills it)\n"
        "machines  workers  keeps_up  CPU ms/1k (all)  per-worker CPU s  busiest share"
        "  projected machines (total, per worker)  projected scaling",
        file=out,
    )
    for s in scaling(results):
        print(
            f"{s['machines']:8d}  {s['workers']:7d}  {'yes' if s['keeps_up'] else 'NO':8}  "
            f"{s['cpu_ms_per_1k']:15.0f}  {' '.join(f'{c:.1f}' for c in s['per_worker_cpu_s']):>16}  "
            f"{s['busiest_worker_share_pct']:12.0f}%  "
            f"{s['projected_machines_total']:23.0f}, {s['projected_machines_per_worker']:14.0f}  "
            f"{s['projected_scaling_factor']:17.2f}",
            file=out,
        )


def print_profiles(results: list[dict[str, Any]], out: Any) -> None:
    """Stage x level: share of the samples and CPU ms per 1,000 messages (share x CPU per 1,000)."""
    for r in results:
        if r["profile"] and r["profile"]["errors"]:
            print(f"py-spy at {r['machines']} machines: {r['profile']['errors']}", file=out)
    levels = [r for r in results if r["profile"] and r["profile"]["samples"]]
    if not levels:
        return
    last = levels[-1]["profile"]["stages"]
    order = [name for name, _ in STAGES]
    names = sorted(
        {s for r in levels for s in r["profile"]["stages"]},
        key=lambda s: (-last.get(s, {}).get("pct", 0), order.index(s) if s in order else len(order)),
    )
    head = "".join(f"  {str(r['machines']) + ' machines: %':>20s}  ms/1k" for r in levels)
    print(f"\n{'worker profile (py-spy --gil; innermost frame)':46s}{head}", file=out)
    for name in names:
        cells = ""
        for r in levels:
            st = r["profile"]["stages"].get(name, {"pct": 0.0, "cpu_ms_per_1k": 0.0})
            cells += f"  {st['pct']:19.1f}%  {st['cpu_ms_per_1k']:5.0f}"
        print(f"{name:46s}{cells}", file=out)
    rows = {
        "total (worker CPU ms/1k msgs)": lambda r: f"{100:19.0f}%  {r['worker_cpu_ms_per_1k']:5.0f}",
        "samples; GIL samples/rate as % of CPU": lambda r: (
            f"{r['profile']['samples']:13d}; {r['profile']['gil_coverage_pct']:4.0f}%       "
        ),
        "py-spy's own CPU s (generator cores)": lambda r: f"{r['profile']['profiler_cpu_s']:20.1f}        ",
    }
    for label, cell in rows.items():
        print(f"{label:46s}" + "".join(f"  {cell(r)}" for r in levels), file=out)
    for r in levels:
        p = r["profile"]
        threads = ", ".join(f"{k} {v:.0f}%" for k, v in p["threads_pct"].items())
        top = next(iter(p["stages"]))
        split = ", ".join(f"{k} {v:.0f}%" for k, v in p["stages"][top]["threads_pct"].items())
        print(f"{r['machines']} machines, by thread: {threads}; {top!r} by thread: {split}", file=out)


if __name__ == "__main__":
    main()
