"""A hostile tenant for the chaos suite (``bench/chaos.py``): what a user of a shared GPU node can
do to TrainGuard without any key -- through the Flight Recorder directory and the reporter socket
the ranks share with the node exporter, and through the names of jobs and nodes (issue #38).

* :func:`hostile_tenant` -- links planted in the exporter's Flight Recorder directory, a hard link
  to a file elsewhere, a memo bomb and a set bomb among the timeout dumps, then a broker outage
  during which the tenant floods the exporter's socket with log lines (some claiming to be the
  kernel's) while the node's kernel logs an Xid: nothing outside ``fr/`` touched, the exporter
  alive throughout, the Xid delivered once the broker is back, no forged kernel line delivered.
* :func:`name_injection` -- job specs, decisions, detections, log lines and steps whose job or node
  names hold ``/``, ``..``, blanks, 300 characters (signed with a trusted key where the topic is
  signed, so they reach the decoders): each dead-lettered at decode naming the field, no file
  written anywhere with such a name, the other job neither recovered nor its spec replaced, and a
  genuine decision afterwards still acted on.  The Slurm executor's own path check and the
  Kubernetes job label are run on the same names in process (defence in depth).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import socket
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from chaos_hostile import Where, _dead_letters, _send_raw
from chaos_procs import XID_79, ChaosStack, TopicReader, end_offsets, free_ports, unique, wait_until
from chaos_scenarios import Result, Size, evict_decision, job_spec

from trainguard.actions.errors import PermanentError
from trainguard.actions.executors.base import ExecutorEnv, StepContext
from trainguard.actions.executors.kubernetes import _label_value, job_label
from trainguard.actions.executors.slurm import SlurmExecutor, SlurmExecutorConfig
from trainguard.actions.progress import Recovery
from trainguard.actions.state import RecoveryState
from trainguard.infra.signing import SIGNED_TOPICS, Signer
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.codec import encode
from trainguard.schemas.control import Decision, Detection, JobSpec, Targets
from trainguard.schemas.enums import Action
from trainguard.schemas.names import NODE_NAME_MAX
from trainguard.schemas.telemetry import Heartbeat
from trainguard.schemas.topics import (
    DEAD_LETTERS,
    DECISIONS,
    DETECTIONS,
    FLIGHT_RECORDER,
    HEARTBEATS,
    JOBS,
    LOGS,
    STEPS,
    Topic,
)
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.workload import FlightRecorderDump, LogLine, TrainingStep

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "flight_recorder"
VALID_DUMP = FIXTURES / "tp2pp2dp2_compute_hang" / "pickle" / "fr_trace_rank_3"
#: the exporter's sources for this scenario: kernel log, reporter socket, heartbeats.
TENANT_SOURCES = [f for src in ("nvml", "nic", "host", "process") for f in ("--disable", src)]


def memo_bomb() -> bytes:
    """57 KB of pickle that is 300 times that in text once every reference is read."""
    shared = [f"frame_{i:05d}" for i in range(4000)]
    doc = {"version": "2.10", "pg_config": {}, "entries": [{"state": "completed", "frames": [shared] * 390}]}
    return pickle.dumps(doc, protocol=4)


def set_bomb(size: int) -> bytes:
    """``size`` bytes of pickle, one empty set (216 bytes in memory) per byte."""
    return b"\x80\x04](" + b"\x8f" * size + b"e."


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root`` (links not followed): its content and mtime."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(root))] = (p.read_bytes(), p.stat().st_mtime_ns)
    return out


def _scrape(port: int, name: str, **labels: str) -> float:
    """The sum of the exporter's samples of ``name`` whose labels include ``labels`` (0: none)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as r:
            text = r.read().decode()
    except OSError:
        return 0.0
    total = 0.0
    for m in re.finditer(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


class _Watch:
    """Polls a process every 0.2 s while it runs: was it ever seen dead?"""

    def __init__(self, alive: Callable[[], bool]) -> None:
        self.alive = alive
        self.died_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            if self.died_at is None and not self.alive():
                self.died_at = round(time.monotonic() - self._t0, 1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


# --- 8. a hostile tenant on the node ------------------------------------------------------------------


def hostile_tenant(stack: ChaosStack, size: Size) -> Result:
    """Links and bombs in the shared Flight Recorder directory, then a log flood through the
    reporter socket during a broker outage: nothing outside ``fr/`` touched, the exporter alive
    throughout, the node's Xid line delivered, no line of the tenant's delivered as the kernel's."""
    res = Result("hostile_tenant")
    job = unique("chaos-ht")
    node = f"{job}-n0"
    (metrics_port,) = free_ports(1)
    cfg = {
        "flight_recorder": {"timeout_poll_s": 0.2, "settle_s": 0.2},
        "delivery": {
            "spool_max_bytes": size.tenant_spool_kib * 1024,
            "spool_segment_bytes": 8 * 1024,
            "delivery_timeout_ms": 5000,
        },
        "metrics": {"host": "127.0.0.1", "port": metrics_port},
    }
    flags = [*TENANT_SOURCES, "--interval", "heartbeat=0.5", "--interval", "kernel_log=0.2"]
    exporter = stack.exporter(node, job, flags, cfg)
    fr = exporter.dir / "fr"
    timeout = fr / "timeout"
    timeout.mkdir(parents=True, exist_ok=True)

    # What the tenant points the links at: files old enough for any sweep (a spool, a home).
    victim = stack.home / unique("ht-victim")
    old = time.time() - 3600
    for rel, data in {
        "a/0000.seg": b"spooled",
        "a/sub/0001.seg": b"spooled too",
        "b/request-like": b"{}",
        "c/quarantine-like": b"kept",
        "d.dump": VALID_DUMP.read_bytes(),
    }.items():
        (victim / rel).parent.mkdir(parents=True, exist_ok=True)
        (victim / rel).write_bytes(data)
    for p in sorted(victim.rglob("*"), reverse=True):
        os.utime(p, (old, old))
    before = _snapshot(victim)
    (fr / "dumps").symlink_to(victim / "a")
    (fr / "requests").symlink_to(victim / "b")
    (timeout / "bad").symlink_to(victim / "c")
    (timeout / "rank_1").symlink_to(victim / "c" / "quarantine-like")
    os.link(victim / "d.dump", timeout / "rank_2")  # a file from elsewhere, under a dump's name
    shutil.copy(VALID_DUMP, timeout / "rank_3")
    (timeout / "rank_5").write_bytes(memo_bomb())
    (timeout / "rank_6").write_bytes(set_bomb(size.tenant_set_bomb_kib * 1024))

    start = end_offsets(stack, [FLIGHT_RECORDER, LOGS, HEARTBEATS])
    dumps = TopicReader(stack, [FLIGHT_RECORDER], start=start)
    exporter.start()
    watch = _Watch(exporter.alive)
    kafka_down = False
    try:
        # 1. The Flight Recorder directory: every dump answered, the bombs refused.
        def answered() -> dict[int, FlightRecorderDump] | None:
            dumps.poll(300)
            got = {e.rank: e for e in dumps.events(FlightRecorderDump, lambda e: e.node == node)}
            return got if {2, 3, 5, 6} <= set(got) else None

        try:
            got = wait_until(answered, 60, "the timeout dumps' events")
        except TimeoutError as exc:
            res.note(str(exc))
            got = {e.rank: e for e in dumps.events(FlightRecorderDump, lambda e: e.node == node)}
        refused = {r: e.error for r, e in got.items() if r in (5, 6) and "budget" in e.error}
        res.extra.update(
            valid_dump_entries=len(got[3].entries) if 3 in got and not got[3].error else 0,
            bombs_refused=len(refused),
            hard_link_refused=2 in got and "links" in got[2].error,
            link_dump_published=1 in got,
        )
        bad = timeout / "bad"
        res.extra["quarantine_is_real_dir"] = bad.is_dir() and not bad.is_symlink()
        res.extra["quarantined"] = sorted(p.name.split(".")[0] for p in bad.iterdir()) if bad.is_dir() else []
        res.extra["links_removed"] = sum(not (fr / s).is_symlink() for s in ("dumps", "requests"))

        # 2. The broker goes away; the node's kernel logs an Xid; the tenant floods the socket.
        xid = f"{XID_79} [{unique('ht-xid')}]"
        forged_tag = unique("ht-forged")
        stack.kafka().stop()
        kafka_down = True
        down_at = time.monotonic()
        with open(exporter.kernel_log, "a") as fh:
            fh.write(f"{xid}\n")
        sent, forged = _flood(exporter.dir / "r.sock", node, job, size.tenant_flood_lines, forged_tag)
        res.extra.update(flood_lines=sent, forged_kernel_lines=forged)

        def dropped() -> float | None:
            n = _scrape(metrics_port, "trainguard_exporter_records_dropped_total", reason="spool_full")
            return n or None

        try:
            wait_until(dropped, 30, "the spool to drop under the flood", 0.5)
        except TimeoutError as exc:
            res.note(f"{exc}: the flood never filled the spool")
        res.extra["spool_dropped"] = int(
            _scrape(metrics_port, "trainguard_exporter_records_dropped_total", reason="spool_full")
        )
        res.extra["reporter_refused"] = int(
            _scrape(metrics_port, "trainguard_exporter_records_dropped_total", reason="reporter_invalid")
        )
        time.sleep(max(0.0, size.tenant_outage_s - (time.monotonic() - down_at)))
        stack.up()
        kafka_down = False
        back, back_ms = time.monotonic(), now_ms()
        res.extra["broker_down_s"] = round(back - down_at, 1)

        # 3. What arrives once the broker is back.
        logs = TopicReader(stack, [LOGS, HEARTBEATS], start=start)

        def xid_seen() -> bool | None:
            logs.poll(500)
            return any(e.source == "kernel" and e.line.endswith(xid) for e in logs.events(LogLine)) or None

        delivered = 0
        try:
            wait_until(xid_seen, 120, "the Xid line after the outage", 0)
            delivered = 1
            res.extra["xid_delivered_after_s"] = round(time.monotonic() - back, 1)
        except TimeoutError as exc:
            res.note(str(exc))
        logs.drain(3)
        lines = logs.events(LogLine, lambda e: e.node == node)
        forged_through = sum(forged_tag in e.line for e in lines)
        res.extra["flood_delivered"] = sum(e.source == "stdout" for e in lines)
        beats = logs.events(Heartbeat, lambda e: e.node == node and e.component == "exporter")
        res.extra["heartbeats_after"] = sum(b.ts_ms >= back_ms for b in beats)  # sent since
        logs.close()
    finally:
        watch.stop()
        if kafka_down:
            with contextlib.suppress(Exception):
                stack.up()
        dumps.close()
    after = _snapshot(victim)
    touched = sorted(k for k in before if after.get(k) != before[k]) + sorted(set(after) - set(before))
    alive = exporter.alive() and watch.died_at is None
    res.extra.update(victim_files=len(before), victim_files_touched=len(touched), exporter_alive=alive)
    res.produced, res.stored, res.lost, res.duplicated = 1, delivered, 1 - delivered, None
    res.accepted_forged = forged_through
    res.note(
        f"fr/dumps, fr/requests, fr/timeout/bad linked outside, a hard link, a {len(memo_bomb()) // 1000} KB "
        f"memo bomb and a {size.tenant_set_bomb_kib} KiB set bomb; broker down "
        f"{res.extra.get('broker_down_s', '?')} s, {res.extra.get('flood_lines', 0)} lines flooded"
    )
    if touched:
        res.note(f"touched outside fr/: {touched[:5]}")
    if watch.died_at is not None:
        res.note(f"the exporter died {watch.died_at} s in: {exporter.log_tail()}")
    res.passed = (
        not touched
        and alive
        and delivered == 1
        and forged_through == 0
        and res.extra.get("bombs_refused") == 2
        and res.extra.get("valid_dump_entries", 0) > 0
        and bool(res.extra.get("hard_link_refused"))
        and not res.extra.get("link_dump_published")
        and res.extra.get("links_removed") == 2
        and res.extra.get("spool_dropped", 0) > 0
        and res.extra.get("heartbeats_after", 0) > 0
    )
    exporter.stop()
    return res


def _flood(sock_path: Path, node: str, job: str, n: int, forged_tag: str) -> tuple[int, int]:
    """``n`` log lines through the reporter socket as a rank would send them (newline-packed
    datagrams); one in 50 claims to be the kernel's.  Returns (sent, of them forged)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.settimeout(5)  # the exporter's queue full: wait (a rank would drop); gone: stop
    sent = forged = 0
    try:
        batch: list[bytes] = []
        for i in range(n):
            if i % 50 == 0:
                ev = LogLine(
                    node=node, ts_ms=now_ms(), source="kernel", line=f"{XID_79} {forged_tag}", job=job
                )
                forged += 1
            else:
                ev = LogLine(node=node, ts_ms=now_ms(), source="stdout", seq=i, job=job,
                             line=f"step {i} loss 2.{i % 10} tokens/s 1234567 " + "x" * 120)  # fmt: skip
            batch.append(encode(ev))
            if len(batch) == 40 or i == n - 1:
                try:
                    s.sendto(b"\n".join(batch), str(sock_path))
                except OSError:  # the exporter is gone (the watch says so) or stuck
                    forged -= sum(b'"source":"kernel"' in b for b in batch)
                    break
                sent += len(batch)
                batch = []
                time.sleep(0.002)
    finally:
        s.close()
    return sent, forged


# --- 9. names that are paths --------------------------------------------------------------------------


def hostile_names(marker: str, victim: str) -> list[str]:
    """Job and node names a tenant may try: each carries ``marker`` where a path would."""
    return [
        f"{marker}/x",
        f"../../{marker}",
        f"{victim}/../{marker}",
        "..",
        ".",
        f"{marker} x",
        f"-{marker}",
        f".{marker}",
        f"{marker}\n",
        marker + "x" * (300 - len(marker)),
        marker + "y" * (NODE_NAME_MAX + 1 - len(marker)),  # one past the longest host name
    ]


def _injected(name: str, victim: str) -> list[tuple[Topic, Event]]:
    """Records naming ``name`` as a job or a node, aimed at ``victim`` where they can be."""
    ts = now_ms()
    topo = JobTopology(
        job=name, tp=1, pp=1, dp=2, ranks_per_machine=1, machines=[f"{victim}-n0", f"{victim}-n1"]
    )
    bad_node = JobTopology(job=victim, tp=1, pp=1, dp=2, ranks_per_machine=1, machines=[f"{victim}-n0", name])
    return [
        (JOBS, JobSpec(job=name, ts_ms=ts, topology=topo)),
        (JOBS, JobSpec(job=victim, ts_ms=ts, topology=bad_node)),  # would replace the victim's spec
        (DECISIONS, evict_decision(name, f"{victim}-n1")),
        (
            DECISIONS,
            Decision(
                decision_id=unique("ni-dec"),
                ts_ms=ts,
                job=victim,
                action=Action.EVICT,
                targets=Targets(machines=[name], group_kind="machine"),
            ),
        ),
        (
            DETECTIONS,
            Detection(
                detection_id=unique("ni-det"),
                ts_ms=ts,
                job=victim,
                kind="xid_79",
                category="cuda_error",
                action=Action.EVICT,
                node=name,
            ),
        ),
        (LOGS, LogLine(node=name, ts_ms=ts, source="kernel", line=XID_79, job=victim)),
        (STEPS, TrainingStep(job=name, rank=0, step=1, ts_ms=ts, loss=1.0)),
    ]


def _files_named(roots: list[Path], marker: str, deep: Path) -> list[str]:
    found = [str(p) for p in deep.rglob(f"*{marker}*")]
    for root in roots:
        with contextlib.suppress(OSError):
            found += [str(p) for p in root.iterdir() if marker in p.name]
    return sorted(set(found))


def _executor_checks(home: Path, names: list[str]) -> dict[str, int]:
    """The executors on the same names, past the codec: the Slurm executor builds no path from
    any (all refused); the Kubernetes label of names an old label merged stays apart."""
    state = home / unique("ni-slurm")
    ex = SlurmExecutor(SlurmExecutorConfig(slurm_conf="/nonexistent"), ExecutorEnv(state_dir=state))
    refused = 0
    for name in names:
        topo = JobTopology(job="j", tp=1, pp=1, dp=1, ranks_per_machine=1, machines=["n1"])
        ctx = StepContext(decision_id="d", step="hot_update", attempt=1, deadline=time.monotonic() + 30)
        try:
            ex.hot_update(JobSpec(job=name, ts_ms=1, topology=topo), "v2", ctx)
        except PermanentError:
            refused += 1
    ex.close()
    long_a, long_b = "x" * 70 + "-a", "x" * 70 + "-b"
    pairs = [(long_a, long_b), ("_llm", "llm"), ("llm_", "llm.")]
    return {
        "slurm_paths_refused": refused,
        "slurm_names_tried": len(names),
        "k8s_old_label_collisions": sum(_label_value(a) == _label_value(b) for a, b in pairs),
        "k8s_label_collisions": sum(job_label(a) == job_label(b) for a, b in pairs),
    }


def name_injection(stack: ChaosStack, size: Size) -> Result:
    """Records whose job or node names are paths, blanks or 300 characters: each dead-lettered at
    decode, no file written with such a name, the other job untouched, the pipeline still acting."""
    res = Result("name_injection")
    victim = unique("chaos-ni")
    marker = unique("tgescape").replace("-", "")
    svc = stack.actions("ni", {"jobs": [victim], "min_standbys": 1})
    svc.start()
    worker = stack.worker("ni-worker", stack.worker_group("chaos-ni")).start()
    worker.wait_ready(stack)
    spec = job_spec(victim, 4)
    stack.send(spec)
    progress = svc.store()
    wait_until(lambda: progress.spec(victim) is not None, 60, "the victim's job spec")
    operator = Signer.load(stack.settings.signing, stack.home, "operator")
    start = end_offsets(stack, [DEAD_LETTERS, DECISIONS])
    dead = TopicReader(stack, [DEAD_LETTERS], start=start)
    decisions = TopicReader(stack, [DECISIONS], start=start)
    names = hostile_names(marker, victim)
    records = [r for i in range(size.injected_rounds) for name in names for r in _injected(name, victim)]
    producer = stack.raw_producer()
    sent: dict[Where, str] = {}
    futures = []
    for topic, ev in records:
        key, value = topic.key_of(ev), encode(ev)
        headers = operator.headers(topic.name, key, value) if topic.name in SIGNED_TOPICS else None
        futures.append((_send_raw(producer, topic.name, key, value, headers), type(ev).__name__))
    producer.flush(60)
    for fut, kind in futures:
        md = fut.get(timeout=60)
        sent[(md.topic, md.partition, md.offset)] = kind
    producer.close()

    def named(where: Where) -> bool:
        return any(re.search(r"name|object key", d.reason) for d in _dead_letters(dead).get(where, []))

    def covered() -> set[Where] | None:
        dead.poll(500)
        got = {w for w in sent if named(w)}
        return got if len(got) >= len(sent) else None

    try:
        got = wait_until(covered, 180, "every injected record dead-lettered", 0.5)
    except TimeoutError as exc:
        res.note(str(exc))
        got = {w for w in sent if named(w)}
    reasons = Counter(d.reason.split(": ", 1)[0] for w in got for d in _dead_letters(dead)[w][:1])
    # Nothing acted on: no recovery of either job, the victim's spec the same, no decision made.
    decisions.drain(2)
    made = decisions.events(Decision, lambda e: e.job == victim)  # the worker's, from an injected line
    recoveries = progress.recoveries()
    spec_now = progress.spec(victim)
    calls = svc.executor_calls()
    acted_on = len(recoveries) + len(made) + int(spec_now is None or spec_now.topology != spec.topology)
    acted_on += sum(marker in str(c) for c in calls)
    # Then a genuine decision for the victim: acted on.
    valid = evict_decision(victim, f"{victim}-n1")
    stack.send(valid)
    try:

        def finished() -> Recovery | None:
            r = progress.get(valid.decision_id)
            return r if r is not None and r.state.terminal else None

        acted = (
            wait_until(finished, 180, "the genuine decision's recovery", 1).state is RecoveryState.SUCCEEDED
        )
    except TimeoutError as exc:
        res.note(str(exc))
        acted = False
    progress.close()
    res.extra.update(_executor_checks(stack.home, names))
    files = _files_named([stack.home.parent, stack.home.parent.parent, Path("/tmp")], marker, stack.home)
    alive = {p.name: p.alive() for p in (worker, svc)}
    dead_procs = [n for n, ok in alive.items() if not ok]
    res.produced = len(sent)
    res.stored = len(got)
    res.lost = len(sent) - len(got)
    res.duplicated = None
    res.accepted_forged = acted_on
    res.decisions_expected, res.decisions_made, res.decisions_acted = 1, 1, int(acted)
    res.extra.update(
        names_tried=len(names),
        records_by_type=dict(Counter(sent.values())),
        dead_letter_reasons=dict(reasons),
        files_with_injected_names=len(files),
    )
    res.note(f"{len(names)} hostile names in {len(sent)} records on {len({w[0] for w in sent})} topics")
    if files:
        res.note(f"files named after an injected name: {files[:5]}")
    if dead_procs:
        res.note(f"died: {', '.join(dead_procs)}")
    res.passed = (
        res.lost == 0
        and acted_on == 0
        and acted
        and not files
        and not dead_procs
        and res.extra["slurm_paths_refused"] == len(names)
        and res.extra["k8s_label_collisions"] == 0
    )
    dead.close()
    decisions.close()
    for p in (worker, svc):
        p.stop()
    return res
