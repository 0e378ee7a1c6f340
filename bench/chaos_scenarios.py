"""Chaos scenarios against servers: a broker killed, ClickHouse stopped, a worker killed, the action
service killed mid-recovery, an eviction storm (``bench/chaos.py``; fuzz and forgery are in
``chaos_hostile.py``).

Each scenario starts the processes it needs on the private stack (:class:`chaos_procs.ChaosStack`),
breaks something, measures from what the servers hold (ClickHouse counted with ``FINAL``, topics
read back, the action service's progress store) and returns a :class:`Result`.  A scenario never
decides ``passed`` from anything but those counts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from chaos_procs import (
    XID_79,
    ChaosStack,
    TopicReader,
    action_event,
    group_members,
    percentile,
    unique,
    wait_decision_probe,
    wait_until,
)

from trainguard.actions.state import RecoveryState
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import (
    ActionEvent,
    ActionPhase,
    DeadLetter,
    Decision,
    Detection,
    JobSpec,
    Targets,
)
from trainguard.schemas.enums import Action, Severity
from trainguard.schemas.topics import ACTIONS, DEAD_LETTERS, DECISIONS, DETECTIONS
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.workload import LogLine, TrainingStep


@dataclass(frozen=True)
class Size:
    """How big each scenario is (:data:`FULL` or :data:`SMALL`)."""

    name: str
    # broker_kill
    exporters: int
    lines_per_s: float
    before_kill_s: float
    broker_down_s: float
    after_restart_s: float
    # clickhouse_outage
    outage_s: float
    steps_per_s: float
    xid_every_s: float
    # worker_kill
    failover_nodes: int
    failover_per_s: float
    # actions_kill: the step each killed recovery is in when the service is killed
    kill_steps: tuple[str, ...]
    # fuzz / forged
    fuzz_records: int
    forged_records: int
    # evict_storm
    storm_jobs: int
    storm_machines: int
    cap_per_job: int
    cap_total: int
    # hostile_tenant: log lines flooded during the broker outage, the exporter's spool bound,
    # the set bomb's size, how long the broker stays down
    tenant_flood_lines: int
    tenant_spool_kib: int
    tenant_set_bomb_kib: int
    tenant_outage_s: float
    # name_injection: rounds of every hostile name in every record type
    injected_rounds: int


FULL = Size(
    "full",
    3,
    20,
    15,
    20,
    15,
    60,
    80,
    3,
    300,
    20,
    ("evict", "swap_standbys", "restart"),
    10_000,
    1_000,
    6,
    12,
    8,
    32,
    20_000,
    512,
    512,
    20,
    10,
)
SMALL = Size(
    "small",
    2,
    10,
    6,
    6,
    6,
    15,
    40,
    2,
    60,
    20,
    ("swap_standbys",),
    500,
    100,
    4,
    6,
    4,
    10,
    5_000,
    128,
    256,
    8,
    2,
)


@dataclass
class Result:
    """One scenario's figures; ``extra`` holds scenario-specific ones (latencies, breakdowns)."""

    name: str
    passed: bool = False
    produced: int | None = None
    stored: int | None = None
    lost: int | None = None
    duplicated: int | None = None
    accepted_forged: int | None = None
    decisions_expected: int | None = None
    decisions_made: int | None = None
    decisions_acted: int | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def note(self, text: str) -> None:
        self.notes.append(text)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "passed": self.passed,
            "produced": self.produced,
            "stored": self.stored,
            "lost": self.lost,
            "duplicated": self.duplicated,
            "accepted_forged": self.accepted_forged,
            "decisions_expected": self.decisions_expected,
            "decisions_made": self.decisions_made,
            "decisions_acted": self.decisions_acted,
            "notes": "; ".join(self.notes),
            "seconds": round(self.seconds, 1),
        }
        out.update({k: v for k, v in self.extra.items() if k not in out})
        return out


def _pump(readers: list[TopicReader], seconds: float, every: Any = None, every_s: float = 1.0) -> None:
    """Read ``readers`` for ``seconds`` (calling ``every()`` each ``every_s``): time passes on purpose."""
    deadline, next_call = time.monotonic() + seconds, time.monotonic()
    while (now := time.monotonic()) < deadline:
        if every is not None and now >= next_call:
            every()
            next_call = now + every_s
        for r in readers:
            r.poll(100)
        if not readers:
            time.sleep(0.1)


# --- 1. broker SIGKILL under exporter load -----------------------------------------------------------


def broker_kill(stack: ChaosStack, size: Size) -> Result:
    """Exporters (spool on) ship kernel-log lines and heartbeats; the broker is SIGKILLed and
    restarted; every line written and every heartbeat sequence number must reach ClickHouse."""
    res = Result("broker_kill")
    job = unique("chaos-bk")
    worker = stack.worker("bk-worker", stack.worker_group("chaos-bk")).start()
    worker.wait_ready(stack)
    flags = ["--disable", "nvml", "--disable", "nic", "--disable", "host", "--disable", "process"]
    flags += ["--disable", "reporter", "--interval", "heartbeat=0.5", "--interval", "kernel_log=0.2"]
    cfg = {"kernel_log": {"all_lines": True}}
    exporters = [stack.exporter(f"{job}-n{i}", job, flags, cfg).start() for i in range(size.exporters)]
    written = Counter[str]()
    stop = threading.Event()

    def write_lines() -> None:  # a steady load: every exporter's kernel log grows
        with contextlib.ExitStack() as opened:
            files = {e.node: opened.enter_context(open(e.kernel_log, "a")) for e in exporters}
            i = 0
            while not stop.wait(1 / size.lines_per_s):
                for node, fh in files.items():
                    fh.write(f"[{time.monotonic():12.6f}] chaos line {i:07d} of {node}\n")
                    fh.flush()
                    written[node] += 1
                i += 1

    writer = threading.Thread(target=write_lines, daemon=True)
    writer.start()
    kafka = stack.kafka()
    try:
        time.sleep(size.before_kill_s)
        pid = kafka.proc.pid()
        if pid is None:
            raise RuntimeError("the private broker is not running")
        os.kill(pid, signal.SIGKILL)  # our private stack's broker, by its pid file
        wait_until(lambda: kafka.proc.pid() is None, 30, "the killed broker to be gone")
        time.sleep(size.broker_down_s)
        t0 = time.monotonic()
        stack.up()  # starts what is not running: the broker, on its old data
        res.extra["broker_restart_s"] = round(time.monotonic() - t0, 1)
        time.sleep(size.after_restart_s)
    finally:
        stop.set()
        writer.join(10)
    restored = time.monotonic()
    store = stack.store()
    nodes = [e.node for e in exporters]

    def lines_stored() -> dict[str, tuple[int, int]]:
        rows = store.query(
            "SELECT node, count(), uniqExact(line) FROM log_lines FINAL "
            "WHERE node IN %(n)s AND position(line, 'chaos line') > 0 GROUP BY node",
            {"n": tuple(nodes)},
        )
        return {str(r[0]): (int(r[1]), int(r[2])) for r in rows}

    produced_lines = sum(written.values())
    try:
        wait_until(
            lambda: sum(u for _, u in lines_stored().values()) >= produced_lines, 240, "every line stored", 2
        )
        res.extra["catch_up_s"] = round(time.monotonic() - restored, 1)
    except TimeoutError as exc:
        res.note(str(exc))
    stored_lines = lines_stored()
    uniq = sum(u for _, u in stored_lines.values())
    rows = sum(c for c, _ in stored_lines.values())
    hb = store.query(
        "SELECT node, min(seq), max(seq), uniqExact(seq), count() FROM heartbeats FINAL "
        "WHERE node IN %(n)s AND component = 'exporter' GROUP BY node",
        {"n": tuple(nodes)},
    )
    hb_range = sum(int(r[2]) - int(r[1]) + 1 for r in hb)
    hb_uniq = sum(int(r[3]) for r in hb)
    hb_rows = sum(int(r[4]) for r in hb)
    res.produced = produced_lines + hb_range
    res.stored = uniq + hb_uniq
    res.lost = (produced_lines - uniq) + (hb_range - hb_uniq)
    res.duplicated = (rows - uniq) + (hb_rows - hb_uniq)
    res.extra.update(
        lines_written=produced_lines,
        lines_stored=uniq,
        heartbeat_seq_range=hb_range,
        heartbeats_stored=hb_uniq,
    )
    alive = {p.name: p.alive() for p in [worker, *exporters]}
    dead = [n for n, ok in alive.items() if not ok]
    healthy = False
    if worker.alive():
        try:
            healthy = wait_until(worker.healthy, 60, "the worker healthy again", 1)
        except TimeoutError:
            res.note(f"worker /healthz after the restart: {worker.healthz()}")
    res.note(
        f"{size.exporters} exporter(s), broker SIGKILLed {size.before_kill_s:g} s into the load, "
        f"down {size.broker_down_s:g} s"
    )
    if dead:
        res.note(f"died: {', '.join(dead)}")
    res.passed = res.lost == 0 and res.duplicated == 0 and not dead and healthy and produced_lines > 0
    for p in [*exporters, worker]:
        p.stop()
    return res


# --- 2. ClickHouse stopped under load ----------------------------------------------------------------


def clickhouse_outage(stack: ChaosStack, size: Size) -> Result:
    """Step telemetry flows while ClickHouse is stopped; Xid probes during the outage must still
    come back as detections and decisions; afterwards every step row is stored once."""
    res = Result("clickhouse_outage")
    job = unique("chaos-ch")
    worker = stack.worker("ch-worker", stack.worker_group("chaos-ch")).start()
    worker.wait_ready(stack)
    decisions, detections = TopicReader(stack, [DECISIONS]), TopicReader(stack, [DETECTIONS])
    produced = 0
    stop = threading.Event()
    t0 = now_ms()

    def produce_steps() -> None:
        nonlocal produced
        p = stack.producer(None)  # step telemetry is not a signed topic
        per_tick = max(1, int(size.steps_per_s / 10))
        try:
            while not stop.wait(0.1):
                for _ in range(per_tick):
                    i = produced
                    p.send(TrainingStep(job=job, rank=i % 8, step=i // 8, ts_ms=t0 + i, loss=1.0))
                    produced += 1
            p.flush()
        finally:
            p.close()

    probes: dict[str, tuple[int, str]] = {}  # node -> (sent ms, phase)
    phase = "before"

    def probe() -> None:
        node = f"{job}-x{len(probes):03d}"
        ts = now_ms()
        probes[node] = (ts, phase)
        stack.send(LogLine(node=node, ts_ms=ts, source="kernel", line=XID_79, job=job))

    steps = threading.Thread(target=produce_steps, daemon=True)
    steps.start()
    readers = [decisions, detections]
    health_during: list[Any] = []
    try:
        _pump(readers, 5, probe, size.xid_every_s)
        stack.clickhouse().stop()
        down_at = time.monotonic()
        phase = "outage"
        _pump(readers, size.outage_s, probe, size.xid_every_s)
        health_during.append(worker.healthz())
        phase = "after"
        stack.up()
        res.extra["clickhouse_down_s"] = round(time.monotonic() - down_at, 1)
        _pump(readers, 5, probe, size.xid_every_s)
    finally:
        stop.set()
        steps.join(30)
    deadline = time.monotonic() + 15  # the last probes' decisions
    while time.monotonic() < deadline and not _all_decided(decisions, job, probes):
        _pump(readers, 0.5)
    latency: dict[str, list[float]] = {"before": [], "outage": [], "after": []}
    decided: set[str] = set()
    for s in decisions.seen:
        if isinstance(s.event, Decision) and s.event.job == job:
            for m in s.event.targets.machines:
                if m in probes and m not in decided:
                    decided.add(m)
                    latency[probes[m][1]].append((s.at_ms - probes[m][0]) / 1000)
    detected = {e.node for e in detections.events(Detection, lambda d: d.job == job)}
    outage_probes = [n for n, (_, ph) in probes.items() if ph == "outage"]
    res.decisions_expected = len(probes)
    res.decisions_made = len(decided)
    for ph, vals in latency.items():
        res.extra[f"decision_p50_s_{ph}"] = _round(percentile(vals, 0.5))
        res.extra[f"decision_max_s_{ph}"] = _round(max(vals) if vals else None)
    res.extra["outage_probes"] = len(outage_probes)
    res.extra["outage_decided"] = sum(1 for n in outage_probes if n in decided)
    res.extra["outage_detected"] = sum(1 for n in outage_probes if n in detected)
    store = stack.store()

    def steps_stored() -> tuple[int, int]:
        row = store.query(
            "SELECT count(), uniqExact(rank, step) FROM training_steps FINAL WHERE job = %(j)s", {"j": job}
        )[0]
        return int(row[0]), int(row[1])

    restored = time.monotonic()
    try:
        wait_until(lambda: steps_stored()[1] >= produced, 240, f"the {produced} steps stored", 2)
        res.extra["catch_up_s"] = round(time.monotonic() - restored, 1)
        wait_until(
            lambda: store.count("decisions", "job = %(j)s", {"j": job}) >= len(decided),
            120,
            "the decisions stored",
            2,
        )
    except TimeoutError as exc:
        res.note(str(exc))
    rows, uniq = steps_stored()
    raw = int(store.query("SELECT count() FROM training_steps WHERE job = %(j)s", {"j": job})[0][0])
    # The probes' decisions: when the load stops, the job's steps stop too and the stall
    # detector (10 s at the default floor) rightly suspects a hang -- not this scenario's business.
    dec_rows = int(
        store.query(
            "SELECT count(), uniqExact(decision_id) FROM decisions FINAL "
            "WHERE job = %(j)s AND hasAny(machines, %(m)s)",
            {"j": job, "m": sorted(probes)},
        )[0][0]
    )
    res.produced, res.stored = produced, uniq
    res.lost = produced - uniq
    res.duplicated = rows - uniq
    res.decisions_acted = None
    res.extra.update(raw_rows_before_merge=raw, decisions_stored=dec_rows)
    ok_outage = res.extra["outage_decided"] == len(outage_probes) and len(outage_probes) > 0
    flowing = ok_outage and res.extra["outage_detected"] == len(outage_probes)
    res.note(
        f"ClickHouse stopped {size.outage_s:g} s; {len(outage_probes)} Xid probe(s) during the outage, "
        f"{res.extra['outage_decided']} decided (max {res.extra['decision_max_s_outage']} s)"
    )
    if health_during and health_during[0] is not None and not health_during[0].get("ok"):
        res.note(f"/healthz at the end of the outage: stalled {health_during[0].get('stalled_agents')}")
    if not worker.alive():
        res.note("the worker died")
    res.passed = (
        res.lost == 0
        and res.duplicated == 0
        and flowing
        and res.decisions_made == res.decisions_expected
        and dec_rows == len(decided)
        and worker.alive()
        and produced > 0
    )
    decisions.close()
    detections.close()
    worker.stop()
    return res


def _all_decided(decisions: TopicReader, job: str, nodes: dict[str, Any]) -> bool:
    done = {m for d in decisions.events(Decision, lambda d: d.job == job) for m in d.targets.machines}
    return set(nodes) <= done


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


# --- 3. a worker SIGKILLed mid-stream ----------------------------------------------------------------


def worker_kill(stack: ChaosStack, size: Size) -> Result:
    """Two workers share the partitions; one is SIGKILLed mid-stream of Xid lines (one machine
    each, over 8 jobs so that both workers decide for some of them).  Every machine must get its
    eviction decision, redelivered ones carry the same id (one row each in ClickHouse, one
    recovery each in a paused action service)."""
    res = Result("worker_kill")
    base = unique("chaos-wk")
    jobs = [f"{base}-j{k}" for k in range(8)]
    nodes = {f"{base}-n{i:04d}": jobs[i % len(jobs)] for i in range(size.failover_nodes)}
    actions = stack.actions("wk", {"jobs": jobs, "max_evictions_per_job_hour": 1_000_000})
    actions.cli("pause", "--reason", "chaos: count accepted decisions only")
    actions.start()
    app_id = stack.worker_group("chaos-wk")
    first = stack.worker("wk-1", app_id).start()
    first.wait_ready(stack)
    second = stack.worker("wk-2", app_id).start()
    wait_until(lambda: second.healthz() is not None, 180, "the second worker")
    try:

        def two_members() -> tuple[str, int] | None:
            g = group_members(stack, app_id)
            return g if g[1] >= 2 and g[0] == "Stable" else None

        state = wait_until(two_members, 90, "a group of two")
        res.extra["group"] = f"{state[1]} members, {state[0]}"
    except TimeoutError as exc:
        res.note(str(exc))
    wait_decision_probe(stack, 120, "the group of two")
    decisions, detections = TopicReader(stack, [DECISIONS]), TopicReader(stack, [DETECTIONS])
    dead = TopicReader(stack, [DEAD_LETTERS])
    sent = 0

    def produce() -> None:
        nonlocal sent
        p = stack.producer(None)
        try:
            for i, (node, job) in enumerate(nodes.items()):
                p.send(LogLine(node=node, ts_ms=now_ms(), source="kernel", line=XID_79, seq=i, job=job))
                sent += 1
                time.sleep(1 / size.failover_per_s)
            p.flush()
        finally:
            p.close()

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()

    def mine() -> list[Decision]:
        return decisions.events(Decision, lambda d: d.job in jobs)

    def decided() -> set[str]:
        decisions.poll()
        return {m for d in mine() for m in d.targets.machines}

    try:
        decisions.wait_for(lambda s: isinstance(s.event, Decision) and s.event.job in jobs, 60)
        wait_until(lambda: sent >= len(nodes) // 3, 60, "a third of the stream sent")
        first.kill()
        res.extra["killed_after_sent"] = sent
        producer.join(300)
        wait_until(lambda: decided() >= set(nodes), 240, "a decision for every machine", 0)
    except TimeoutError as exc:
        res.note(str(exc))
    decisions.drain(3)
    ids_by_node: dict[str, set[str]] = {}
    for d in mine():
        for m in d.targets.machines:
            ids_by_node.setdefault(m, set()).add(d.decision_id)
    distinct = {d.decision_id for d in mine()}
    records = len(mine())
    res.decisions_expected = len(nodes)
    res.decisions_made = len(distinct)
    missing = [n for n in nodes if n not in ids_by_node]
    split = [n for n, ids in ids_by_node.items() if len(ids) > 1]
    store = stack.store()
    where, params = "job IN %(j)s", {"j": tuple(jobs)}
    try:
        wait_until(
            lambda: store.count("decisions", where, params) >= len(distinct), 120, "decisions stored", 2
        )
    except TimeoutError as exc:
        res.note(str(exc))
    rows = store.count("decisions", where, params)
    progress = actions.store()

    def accepted() -> int:
        return sum(len(progress.recoveries(j, 100_000)) for j in jobs)

    try:
        wait_until(lambda: accepted() >= len(distinct), 60, "decisions accepted", 1)
    except TimeoutError as exc:
        res.note(str(exc))
    n_accepted = accepted()
    progress.close()
    res.produced, res.stored = len(nodes), rows
    res.lost = len(missing)
    res.duplicated = max(rows - len(nodes), n_accepted - len(nodes), len(split), 0)
    res.decisions_acted = n_accepted
    res.extra.update(decision_records=records, duplicates_absorbed=records - len(distinct))
    res.note(
        f"{len(nodes)} Xid lines over {len(jobs)} jobs, worker 1 of 2 SIGKILLed after "
        f"{res.extra.get('killed_after_sent')}; {records - len(distinct)} redelivered decision record(s), "
        "same ids"
    )
    if split:
        res.note(f"{len(split)} machine(s) got more than one decision id: {split[:3]}")
    if missing:
        detections.drain()
        detected = {d.node for d in detections.events(Detection, lambda d: d.job in jobs)}
        res.note(
            f"no decision for {missing[:5]} (detected: {[n in detected for n in missing[:5]]}; "
            f"sent #{[list(nodes).index(n) for n in missing[:5]]})"
        )
        res.note(f"surviving worker /healthz: {second.healthz()}")
        # What the survivor said of its partitions (seeks back, stuck partitions): why a record
        # was missed is in there if anywhere.
        said = [
            ln
            for ln in second.log.read_text(errors="replace").splitlines()
            if "WARNING" in ln or "ERROR" in ln
        ]
        res.note(f"surviving worker's last warnings: {[ln[-300:] for ln in said[-8:]]}")
        dead.drain()
        letters = [d for d in dead.events(DeadLetter) if d.stage.startswith("worker:")]
        res.note(f"{len(letters)} worker dead letter(s): {[(d.stage, d.reason[:200]) for d in letters[:3]]}")
    if not second.alive():
        res.note("the surviving worker died")
    res.passed = (
        not missing
        and not split
        and rows == len(nodes)
        and n_accepted == len(nodes)
        and len(distinct) == len(nodes)
        and second.alive()
        and actions.alive()
    )
    decisions.close()
    detections.close()
    dead.close()
    second.stop()
    actions.stop()
    return res


# --- 4. the action service SIGKILLed mid-recovery ----------------------------------------------------


def job_spec(job: str, machines: int, standbys: int = 2) -> JobSpec:
    topo = JobTopology(
        job=job,
        tp=1,
        pp=1,
        dp=machines,
        ranks_per_machine=1,
        machines=[f"{job}-n{i}" for i in range(machines)],
    )
    return JobSpec(
        job=job, ts_ms=now_ms(), topology=topo, standbys=[f"{job}-warm{i}" for i in range(standbys)]
    )


def evict_decision(job: str, machine: str) -> Decision:
    return Decision(
        decision_id=unique("chaos-dec"),
        ts_ms=now_ms(),
        job=job,
        action=Action.EVICT,
        targets=Targets(machines=[machine], group_kind="machine"),
        reason="chaos",
    )


def actions_kill(stack: ChaosStack, size: Size) -> Result:
    """The action service (dry_run executor, slowed steps) is SIGKILLed while a recovery is in
    ``step``; restarted, it must finish that recovery, running no step's effect twice, and a
    redelivered decision is a no-op."""
    res = Result("actions_kill")
    jobs = {step: unique(f"chaos-ak-{step.replace('_', '')}") for step in size.kill_steps}
    delays = {"stop": 0.5, "evict": 2.0, "activate_standbys": 3.0, "restart": 2.0}
    svc = stack.actions(
        "ak", {"jobs": list(jobs.values()), "executor_options": {"delays": delays}, "min_standbys": 1}
    )
    svc.start()
    acts = TopicReader(stack, [ACTIONS])
    stack.send(*[job_spec(j, 4) for j in jobs.values()])
    decisions: dict[str, Decision] = {}
    resume_s: list[float] = []

    def phase_seen(d: Decision, step: str, phase: ActionPhase) -> bool:
        return any(
            isinstance(e, ActionEvent)
            and e.decision_id == d.decision_id
            and e.step == step
            and e.phase is phase
            for e in acts.events(ActionEvent)
        )

    for step, job in jobs.items():
        d = decisions[step] = evict_decision(job, f"{job}-n1")
        stack.send(d)
        try:
            acts.wait_for(action_event(d.decision_id, step, ActionPhase.STARTED), 180)
        except TimeoutError:
            res.note(f"{step}: never started; log: {svc.log_tail(500)}")
            continue
        svc.kill()
        t0 = time.monotonic()
        if phase_seen(d, "recovery", ActionPhase.SUCCEEDED):
            res.note(f"{step}: finished before the kill")
        svc.start()
        try:
            done = action_event(d.decision_id, "recovery", ActionPhase.SUCCEEDED, ActionPhase.FAILED)
            acts.wait_for(done, 180)
            resume_s.append(time.monotonic() - t0)
        except TimeoutError:
            res.note(f"{step}: not finished after the restart")
    # Every decision again (a redelivery, freshly signed): each must be a no-op.
    again = stack.send(*decisions.values())
    time.sleep(3)
    acts.drain(2)
    store = svc.store()
    calls = svc.executor_calls()
    completed = 0
    for step, d in decisions.items():
        rec = store.get(d.decision_id)
        mine = [c for c in calls if c["decision_id"] == d.decision_id]
        kinds = Counter(c["call"] for c in mine if not (c["call"] == "evict" and c["args"].get("noop")))
        finals = {
            e.event_id
            for e in acts.events(ActionEvent)
            if e.decision_id == d.decision_id and e.step == "recovery" and e.phase is ActionPhase.SUCCEEDED
        }
        steps = {s["key"]: s["attempts"] for s in store.steps(d.decision_id)}
        once = all(kinds[k] == 1 for k in ("stop", "evict", "activate_standbys", "restart"))
        ok = rec is not None and rec.state is RecoveryState.SUCCEEDED and once and len(finals) == 1
        completed += ok
        res.note(
            f"killed in {step}: {rec.state.value if rec else 'missing'}, calls "
            f"{dict(sorted(kinds.items()))}, {len(finals)} final event(s), attempts {steps}"
        )
    recs = len(store.recoveries(None, 10_000))
    store.close()
    res.decisions_expected = len(decisions)
    res.decisions_made = len(decisions)
    res.decisions_acted = completed
    res.produced = len(decisions) + len(again)
    res.stored = recs
    res.duplicated = recs - len(decisions)
    res.lost = len(decisions) - completed
    res.extra["resume_s_max"] = _round(max(resume_s) if resume_s else None)
    res.note(
        f"{len(decisions)} decision(s), each sent again after its recovery (a redelivery): "
        f"{recs} recovery(ies) recorded"
    )
    res.passed = completed == len(decisions) and recs == len(decisions) and svc.alive()
    acts.close()
    svc.stop()
    return res


# --- 7. an evict-all storm ---------------------------------------------------------------------------


def evict_storm(stack: ChaosStack, size: Size) -> Result:
    """A detector gone mad reports every machine of several jobs for eviction at once: the worker
    decides them all, the blast-radius guard lets at most its caps through and holds the rest."""
    res = Result("evict_storm")
    jobs = [unique(f"chaos-storm{i}") for i in range(size.storm_jobs)]
    svc = stack.actions(
        "storm",
        {
            "jobs": jobs,
            "max_evictions_per_job_hour": size.cap_per_job,
            "max_evictions_per_hour": size.cap_total,
            "min_standbys": 1,
            # The caps are what this scenario measures.  The circuit breaker would hold the
            # whole storm before any cap is reached (every machine of a job, one cause, at once:
            # tests/actions/test_breaker.py), so it is off here.
            "breaker": {"window_s": 0},
        },
    )
    svc.start()
    worker = stack.worker("storm-worker", stack.worker_group("chaos-storm")).start()
    worker.wait_ready(stack)
    stack.send(*[job_spec(j, size.storm_machines) for j in jobs])
    decisions = TopicReader(stack, [DECISIONS])
    mad = [
        Detection(
            detection_id=unique("mad"),
            ts_ms=now_ms(),
            job=j,
            kind="chaos_mad_detector",
            category="gpu_unavailable",
            severity=Severity.CRITICAL,
            action=Action.EVICT,
            node=f"{j}-n{i}",
            message="a detector gone mad: evict everything",
            source_ts_ms=now_ms(),
        )
        for j in jobs
        for i in range(size.storm_machines)
    ]
    stack.send(*mad, principal="worker")
    expected = len(mad)
    try:
        wait_until(
            lambda: (
                (
                    decisions.poll(),
                    len({d.decision_id for d in decisions.events(Decision, lambda d: d.job in jobs)}),
                )[1]
                >= expected
            ),
            120,
            "every storm decision",
            0,
        )
    except TimeoutError as exc:
        res.note(str(exc))
    made = {d.decision_id for d in decisions.events(Decision, lambda d: d.job in jobs)}
    store = svc.store()

    def settled() -> dict[str, Counter[str]] | None:
        by_job = {j: Counter(r.state.value for r in store.recoveries(j, 10_000)) for j in jobs}
        total = sum(sum(c.values()) for c in by_job.values())
        busy = any(s not in ("succeeded", "held", "pending") for c in by_job.values() for s in c)
        # A job's queue waits behind a held recovery; one with pending work and none held moves on.
        moving = any(c["pending"] and not c["held"] for c in by_job.values())
        return by_job if total >= len(made) and not busy and not moving else None

    try:
        wait_until(settled, 180, "the recoveries to settle", 1)
        time.sleep(3)  # nothing more moves
    except TimeoutError as exc:
        res.note(str(exc))
    by_job = {j: Counter(r.state.value for r in store.recoveries(j, 10_000)) for j in jobs}
    held = [r for j in jobs for r in store.recoveries(j, 10_000) if r.state is RecoveryState.HELD]
    store.close()
    evicted: Counter[str] = Counter()
    for c in svc.executor_calls():
        if c["call"] == "evict" and c["job"] in jobs and not c["args"].get("noop"):
            evicted[c["job"]] += len(c["args"]["machines"])
    total = sum(evicted.values())
    cap = min(size.cap_total, sum(min(size.cap_per_job, size.storm_machines) for _ in jobs))
    succeeded = sum(c["succeeded"] for c in by_job.values())
    pending = sum(c["pending"] for c in by_job.values())
    other = sum(n for c in by_job.values() for s, n in c.items() if s not in ("succeeded", "held", "pending"))
    reasons = Counter(r.held_reason.split(":")[0] for r in held)
    res.decisions_expected = expected
    res.decisions_made = len(made)
    res.decisions_acted = succeeded
    res.produced, res.stored = expected, sum(sum(c.values()) for c in by_job.values())
    res.lost = expected - res.stored
    res.duplicated = 0 if res.stored <= expected else res.stored - expected
    res.extra.update(
        evicted=total,
        eviction_cap=cap,
        held=len(held),
        held_by=dict(reasons),
        queued_behind_held=pending,
        max_evicted_per_job=max(evicted.values(), default=0),
    )
    res.note(
        f"{expected} eviction decisions over {len(jobs)} job(s); evicted {total} machine(s) "
        f"(caps {size.cap_per_job}/job, {size.cap_total} in all), {len(held)} held for an operator "
        f"({', '.join(f'{k}: {n}' for k, n in sorted(reasons.items())) or '-'}), {pending} queued behind them"
    )
    if reasons["restart budget"]:
        res.note(
            f"{reasons['restart budget']} job(s) held by the restart budget (each eviction restarts "
            "the job) before reaching the per-job eviction cap"
        )
    res.passed = (
        len(made) == expected
        and total == cap
        and max(evicted.values(), default=0) <= size.cap_per_job
        and succeeded == total
        and reasons["blast radius"] >= 1
        and set(reasons) <= {"blast radius", "restart budget"}
        and other == 0
        and res.lost == 0
        and svc.alive()
        and worker.alive()
    )
    decisions.close()
    worker.stop()
    svc.stop()
    return res
