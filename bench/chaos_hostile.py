"""Hostile input for the chaos suite (``bench/chaos.py``): a flood of fuzzed records on every
topic, and forged control-plane records (unsigned, unknown key, wrong role, expired, dated in the
future, tampered with, replayed).

Fuzzed records on the signed topics are signed with a trusted key, so they get past the signature
check and reach the decoders (a producer holding a key can still send garbage); every one of them
must come back as a dead letter with a reason.  Forged records must be dead-lettered at the
signature check and change nothing: no recovery accepted, no job spec replaced, no exporter or
worker setting applied.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from chaos_procs import (
    XID_79,
    ChaosStack,
    TopicReader,
    end_offsets,
    unique,
    wait_decision_probe,
    wait_until,
)
from chaos_scenarios import Result, Size, evict_decision, job_spec

from trainguard.actions.progress import Recovery
from trainguard.actions.state import RecoveryState
from trainguard.infra.signing import SIGNED_TOPICS, Signer, SigningConfig, init_keys
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.codec import encode, to_dict
from trainguard.schemas.control import (
    ActionEvent,
    ActionPhase,
    Command,
    CommandKind,
    DeadLetter,
    Decision,
    Detection,
    JobSpec,
)
from trainguard.schemas.enums import Action
from trainguard.schemas.telemetry import (
    GpuSample,
    GpuSampleBatch,
    Heartbeat,
    HostSample,
    NicSample,
    NicSampleBatch,
    NodeCheck,
)
from trainguard.schemas.topics import (
    COMMANDS,
    CONTROL,
    DEAD_LETTERS,
    DECISIONS,
    HEARTBEATS,
    JOBS,
    TOPICS,
    Topic,
)
from trainguard.schemas.workload import (
    FlightRecorderDump,
    LogLine,
    ProcessExit,
    RankLiveness,
    StackDump,
    TrainingStep,
)

#: a record's coordinates on the broker.
Where = tuple[str, int, int]
KINDS = (
    "random_bytes",
    "truncated_json",
    "lone_surrogate",
    "huge_number",
    "wrong_version",
    "out_of_range",
    "wrong_type",
    "too_deep",
    "not_an_object",
    "tombstone",
)
#: per event type, values that pass the JSON types but not the field bounds (besides ``ts_ms`` in
#: microseconds, which every type gets).
OUT_OF_RANGE: dict[str, list[tuple[str, Any]]] = {
    "training_step": [("mfu", 1.7), ("rank", -3), ("step", 2**63)],
    "detection": [("ranks", [2**40])],
    "decision": [("targets", {"machines": ["x" * 300]})],
    "process_exit": [("exit_code", 999)],
    "heartbeat": [("seq", -1)],
    "dead_letter": [("partition", 10**7)],
    "host": [("cpu_util_pct", 150.0)],
    "log_line": [("seq", -1)],
    "gpu_batch": [("gpus", [{"index": 5000}])],
    "nic_batch": [("nics", [{"name": "eth0", "rx_bytes": 2**64}])],
    "stack_dump": [("round", 10**6)],
    "action_event": [("duration_ms", -1.0)],
    "command": [("args", {"x": "\ud800"})],
    "job_spec": [("topology", {"job": "j", "tp": 0})],
    "node_check": [("duration_s", -1.0), ("node", "")],
}

#: an exporter that runs only the sources a scenario needs (kernel log, heartbeat, commands).
QUIET_SOURCES = [f for src in ("nvml", "nic", "host", "process", "reporter") for f in ("--disable", src)]


def sample(topic: Topic, tag: str) -> Event:
    """A valid event of ``topic``'s type (the base that mutations break)."""
    ts = now_ms()
    node, job = f"{tag}-node", f"{tag}-job"
    by_type: dict[type[Event], Callable[[], Event]] = {
        GpuSampleBatch: lambda: GpuSampleBatch(
            node=node, ts_ms=ts, gpus=[GpuSample(index=0, util_gpu_pct=50.0)]
        ),
        HostSample: lambda: HostSample(
            node=node,
            ts_ms=ts,
            cpu_util_pct=5.0,
            load1=1,
            load5=1,
            load15=1,
            mem_total_bytes=1 << 30,
            mem_available_bytes=1 << 29,
        ),
        NicSampleBatch: lambda: NicSampleBatch(node=node, ts_ms=ts, nics=[NicSample(name="eth0")]),
        LogLine: lambda: LogLine(node=node, ts_ms=ts, source="kernel", line="fuzz", job=job),
        Heartbeat: lambda: Heartbeat(node=node, component="exporter", ts_ms=ts),
        TrainingStep: lambda: TrainingStep(job=job, rank=0, step=1, ts_ms=ts, loss=1.0),
        ProcessExit: lambda: ProcessExit(node=node, ts_ms=ts, pid=1, job=job, exit_code=1),
        StackDump: lambda: StackDump(job=job, node=node, rank=0, pid=1, capture_id="c", ts_ms=ts),
        RankLiveness: lambda: RankLiveness(job=job, node=node, ts_ms=ts, ranks=[0], states=["S"]),
        FlightRecorderDump: lambda: FlightRecorderDump(job=job, node=node, rank=0, ts_ms=ts, capture_id="c"),
        Detection: lambda: Detection(
            detection_id=unique("det"),
            ts_ms=ts,
            job=job,
            kind="fuzz",
            category="fuzz",
            action=Action.EVICT,
            node=node,
        ),
        Decision: lambda: replace(evict_decision(job, node), ts_ms=ts),
        ActionEvent: lambda: ActionEvent(
            event_id=unique("ev"), decision_id="d", ts_ms=ts, job=job, step="stop", phase=ActionPhase.STARTED
        ),
        Command: lambda: Command(
            command_id=unique("cmd"),
            ts_ms=ts,
            kind=CommandKind.SET_INTERVAL,
            node=node,
            args={"source": "heartbeat", "interval_s": 5},
        ),
        JobSpec: lambda: job_spec(job, 2),
        DeadLetter: lambda: DeadLetter(ts_ms=ts, topic="trainguard.telemetry.gpu", reason="fuzz"),
        NodeCheck: lambda: NodeCheck(check_id=unique("chk"), node=node, ts_ms=ts, origin="fuzz"),
    }
    return by_type[topic.event]()


def fuzz_value(kind: str, topic: Topic, rng: random.Random, tag: str) -> bytes | None:
    """One broken record of ``kind`` for ``topic``: never a valid event of the topic."""
    ev = sample(topic, tag)
    d = to_dict(ev)
    if kind == "random_bytes":
        return rng.randbytes(rng.randint(1, 300))
    if kind == "truncated_json":
        full = encode(ev)
        return full[: rng.randint(1, len(full) - 1)]
    if kind == "lone_surrogate":
        name = rng.choice([k for k, v in d.items() if isinstance(v, str) and k != "schema"])
        d[name] = "\ud800" + d[name]
        return json.dumps(d, ensure_ascii=True).encode()  # "\ud800" as a JSON escape: valid JSON
    if kind == "huge_number":
        d["ts_ms"] = "__HUGE__"
        return json.dumps(d).replace('"__HUGE__"', "9" * 4301).encode()
    if kind == "wrong_version":
        # A version the schema does not read: never its own nor one it upgrades from (a fixed
        # list went stale when JobSpec, NicSampleBatch and Heartbeat reached version 2).
        readable = {type(ev).VERSION, *type(ev).UPGRADES}
        d["version"] = rng.choice([v for v in (0, 2, 3, 7, -1, 10**6) if v not in readable])
        return json.dumps(d).encode()
    if kind == "out_of_range":
        choices: list[tuple[str, Any]] = [("ts_ms", now_ms() * 1000), *OUT_OF_RANGE.get(ev.TYPE, [])]
        name, value = rng.choice(choices)
        d[name] = value
        return json.dumps(d, ensure_ascii=True).encode()
    if kind == "wrong_type":
        other = rng.choice([t for t in TOPICS if t.event is not topic.event])
        return encode(sample(other, tag))
    if kind == "too_deep":
        return b'{"schema":"' + ev.TYPE.encode() + b'","version":1,"x":' + b"[" * 100 + b"]" * 100 + b"}"
    if kind == "not_an_object":
        return rng.choice([b"[1,2,3]", b'"a string"', b"null", b"42", b"", b"NaN"])
    if kind == "tombstone":
        return None
    raise ValueError(kind)


def _dead_letters(reader: TopicReader) -> dict[Where, list[DeadLetter]]:
    out: dict[Where, list[DeadLetter]] = {}
    for s in reader.seen:
        if isinstance(s.event, DeadLetter):
            d = s.event
            out.setdefault((d.topic, d.partition, d.offset), []).append(d)
    return out


def _send_raw(producer: Any, topic: str, key: bytes | None, value: bytes | None, headers: Any) -> Any:
    return producer.send(topic, key=key, value=value, headers=headers or None)


# --- 5. a flood of fuzzed records --------------------------------------------------------------------


def fuzz_flood(stack: ChaosStack, size: Size) -> Result:
    """Fuzzed records on every topic: each one dead-lettered with a reason, every process alive,
    a signed decision sent after the flood still acted on."""
    res = Result("fuzz_flood")
    job = unique("chaos-fz")
    svc = stack.actions("fz", {"jobs": [job], "min_standbys": 1})
    svc.start()
    worker = stack.worker("fz-worker", stack.worker_group("chaos-fz")).start()
    worker.wait_ready(stack)
    exporter = stack.exporter(
        f"{job}-n0",
        job,
        [*QUIET_SOURCES],
        {},
    ).start()
    stack.send(job_spec(job, 4))
    operator = Signer.load(stack.settings.signing, stack.home, "operator")
    producer = stack.raw_producer()

    def send(topic: Topic, key: bytes | None, value: bytes | None, headers: Any) -> Where:
        md = _send_raw(producer, topic.name, key, value, headers).get(timeout=30)
        return (md.topic, md.partition, md.offset)

    # The exporter's command listener starts at the end of its topic: garbage sent before it has
    # joined would never reach it.
    if _exporter_command(stack, operator, exporter.node, send, {}) is None:
        res.note("the exporter never confirmed a command (the flood may not reach its listener)")
    start = end_offsets(stack, [DEAD_LETTERS])
    dead = TopicReader(stack, [DEAD_LETTERS], start=start)
    rng = random.Random(11)
    sent: dict[Where, str] = {}
    futures: list[tuple[Any, str]] = []
    t0 = time.monotonic()
    for i in range(size.fuzz_records):
        topic = TOPICS[i % len(TOPICS)]
        kind = KINDS[(i // len(TOPICS)) % len(KINDS)]
        value = fuzz_value(kind, topic, rng, f"{job}-fz{i}")
        key = f"{job}-k{i % 17}".encode()
        headers = operator.headers(topic.name, key, value) if topic.name in SIGNED_TOPICS else None
        futures.append((_send_raw(producer, topic.name, key, value, headers), kind))
    producer.flush(60)
    for fut, kind in futures:
        md = fut.get(timeout=60)
        sent[(md.topic, md.partition, md.offset)] = kind
    producer.close()
    res.extra["flood_send_s"] = round(time.monotonic() - t0, 1)
    store = stack.store()
    dl_topic = [w for w in sent if w[0] == DEAD_LETTERS.name]

    def covered() -> set[Where]:
        dead.poll(500)
        got = {w for w, ds in _dead_letters(dead).items() if w in sent and any(d.reason for d in ds)}
        if dl_topic:  # garbage on the dead-letter topic itself is stored, not re-published
            lo, hi = min(w[2] for w in dl_topic), max(w[2] for w in dl_topic)
            rows = store.query(
                "SELECT partition, offset FROM dead_letters FINAL WHERE topic = %(t)s "
                "AND offset >= %(lo)s AND offset <= %(hi)s AND reason != ''",
                {"t": DEAD_LETTERS.name, "lo": lo, "hi": hi},
            )
            got |= {(DEAD_LETTERS.name, int(p), int(o)) for p, o in rows} & set(dl_topic)
        return got

    got: set[Where] = set()
    deadline = time.monotonic() + (600 if size.name == "full" else 180)
    while time.monotonic() < deadline:
        got = covered()
        if len(got) >= len(sent):
            break
        time.sleep(1)
    res.extra["dead_lettered_after_s"] = round(time.monotonic() - t0, 1)
    # The pipeline still works: a worker decision, and a signed decision acted on.
    alive_after = {p.name: p.alive() for p in (worker, svc, exporter)}
    try:
        probe_s = wait_decision_probe(stack, 120, "the worker after the flood")
        res.extra["probe_decision_s"] = round(probe_s, 2)
    except TimeoutError as exc:
        res.note(str(exc))
    valid = evict_decision(job, f"{job}-n1")
    stack.send(valid)
    progress = svc.store()
    try:

        def finished() -> Recovery | None:
            r = progress.get(valid.decision_id)
            return r if r is not None and r.state.terminal else None

        rec = wait_until(finished, 180, "the valid decision's recovery", 1)
        acted = rec.state is RecoveryState.SUCCEEDED
    except TimeoutError as exc:
        res.note(str(exc))
        acted = False
    progress.close()
    healthy = (
        wait_until(lambda: worker.healthy() or None, 120, "worker healthy", 2) if worker.alive() else False
    )
    missing = {w: k for w, k in sent.items() if w not in got}
    by_kind = Counter(sent.values())
    missed_kind = Counter(missing.values())
    stages = Counter(d.stage for ds in _dead_letters(dead).values() for d in ds)
    res.produced = len(sent)
    res.stored = len(got)
    res.lost = len(missing)
    res.duplicated = None
    res.accepted_forged = None
    res.decisions_expected, res.decisions_made, res.decisions_acted = 1, 1, int(acted)
    res.extra.update(
        records_by_kind=dict(by_kind),
        not_dead_lettered_by_kind=dict(missed_kind),
        dead_letter_stages=dict(stages),
        topics=len(TOPICS),
    )
    res.note(f"{len(sent)} fuzzed records on {len(TOPICS)} topics, {len(got)} dead-lettered with a reason")
    if missing:
        sample_missing = sorted(missing.items())[:3]
        res.note(f"not dead-lettered: {dict(missed_kind)}, e.g. {sample_missing}")
    dead_procs = [n for n, ok in alive_after.items() if not ok]
    if dead_procs:
        res.note(f"died: {', '.join(dead_procs)}")
    if not healthy:
        res.note(f"worker /healthz: {worker.healthz()}")
    res.passed = (
        not missing and not dead_procs and acted and bool(healthy) and "probe_decision_s" in res.extra
    )
    dead.close()
    for p in (exporter, worker, svc):
        p.stop()
    return res


# --- 6. forged control-plane records -----------------------------------------------------------------


def _signed(signer: Signer, topic: Topic, ev: Event, at_ms: int | None = None) -> tuple[bytes, bytes, Any]:
    key, value = topic.key_of(ev), encode(ev)
    return key, value, signer.headers(topic.name, key, value, now_ms=at_ms)


def forged_control(stack: ChaosStack, size: Size) -> Result:
    """Forged decisions, job specs, exporter commands and worker control commands: none is acted
    on, each is dead-lettered at the signature check."""
    res = Result("forged_control")
    job = unique("chaos-fg")
    node = f"{job}-n0"
    cfg, home = stack.settings.signing, stack.home
    signers = {p: Signer.load(cfg, home, p) for p in ("operator", "worker", "actions")}
    operator = signers["operator"]
    rogue_dir = home / "rogue-keys"
    init_keys(rogue_dir, ["operator"])
    rogue = Signer.load(SigningConfig(enabled=True, keys_dir=str(rogue_dir)), home, "operator")

    def as_role(principal: str) -> Signer:  # a trusted role's real key, signing what its role may not
        s = signers[principal]
        return Signer(s.private_key, s.kid, "operator", cfg)

    svc = stack.actions("fg", {"jobs": [job], "min_standbys": 1})
    svc.start()
    worker = stack.worker("fg-worker", stack.worker_group("chaos-fg")).start()
    worker.wait_ready(stack)
    exporter = stack.exporter(
        node,
        job,
        [
            *QUIET_SOURCES,
            "--interval",
            "heartbeat=2",
        ],
        {},
    ).start()
    producer = stack.raw_producer()

    def send(topic: Topic, key: bytes | None, value: bytes | None, headers: Any) -> Where:
        md = _send_raw(producer, topic.name, key, value, headers).get(timeout=30)
        return (md.topic, md.partition, md.offset)

    # The authentic originals (what a replay copies), each seen by its consumer first.
    spec = job_spec(job, 4)
    originals: dict[str, tuple[bytes, bytes, Any]] = {JOBS.name: _signed(operator, JOBS, spec)}
    send(JOBS, *originals[JOBS.name])
    progress = svc.store()
    wait_until(lambda: progress.spec(job) is not None, 60, "the authentic job spec")
    d0 = evict_decision(job, f"{job}-n1")
    originals[DECISIONS.name] = _signed(operator, DECISIONS, d0)
    send(DECISIONS, *originals[DECISIONS.name])
    wait_until(
        lambda: (r := progress.get(d0.decision_id)) is not None and r.state.terminal, 120, "d0 done", 0.5
    )
    k0 = Command(
        command_id=unique("k0"),
        ts_ms=now_ms(),
        kind=CommandKind.SET_THRESHOLD,
        args={"path": "decide.incident_max_s", "value": 300.0, "app_id": worker.app_id},
    )
    originals[CONTROL.name] = _signed(operator, CONTROL, k0)
    k0_at = send(CONTROL, *originals[CONTROL.name])
    wait_until(lambda: worker.followed(CONTROL).get(k0_at[1], 0) > k0_at[2], 60, "the worker to read k0")
    c0_at = _exporter_command(stack, operator, node, send, originals)
    res.extra["exporter_command_ready"] = c0_at is not None
    start = end_offsets(stack, [DEAD_LETTERS])
    dead = TopicReader(stack, [DEAD_LETTERS], start=start)

    forged_ids: list[str] = []

    def payload(topic: Topic, i: int) -> Event:
        """What the forger wants done."""
        ts = now_ms()
        if topic is DECISIONS:
            d = evict_decision(job, f"{job}-n{2 + i % 2}")
            forged_ids.append(d.decision_id)
            return d
        if topic is JOBS:
            return replace(job_spec(job, 8), ts_ms=ts + 1)  # "latest spec wins": it would move the job
        if topic is COMMANDS:
            return Command(
                command_id=unique("forged"),
                ts_ms=ts,
                kind=CommandKind.SET_INTERVAL,
                node=node,
                args={"source": "heartbeat", "interval_s": 0.1},
            )
        return Command(
            command_id=unique("forged"),
            ts_ms=ts,
            kind=CommandKind.SET_THRESHOLD,
            # Both together would make the probe's repeated Xid two decisions: a forger who got
            # both through shows in it.
            args={"path": _INCIDENT_PATHS[(i // 4) % 2], "value": 0.0, "app_id": worker.app_id},
        )

    wrong_role = {DECISIONS.name: None, JOBS.name: "worker", COMMANDS.name: "actions", CONTROL.name: "worker"}
    kinds = ["unsigned", "unknown_key", "wrong_role", "expired", "future", "tampered", "replayed"]
    topics = [DECISIONS, JOBS, COMMANDS, CONTROL]
    forged: dict[Where, str] = {}
    for i in range(size.forged_records):
        topic = topics[i % len(topics)]
        kind = kinds[(i // len(topics)) % len(kinds)]
        if kind == "wrong_role" and wrong_role[topic.name] is None:
            kind = "tampered"  # every role may sign decisions
        if kind == "replayed":
            key, value, headers = originals[topic.name]
        else:
            ev = payload(topic, i)
            key, value = topic.key_of(ev), encode(ev)
            ttl = operator.ttl_ms(topic.name)
            if kind == "unsigned":
                headers = None
            elif kind == "unknown_key":
                headers = rogue.headers(topic.name, key, value)
            elif kind == "wrong_role":
                headers = as_role(str(wrong_role[topic.name])).headers(topic.name, key, value)
            elif kind == "expired":
                headers = operator.headers(topic.name, key, value, now_ms=now_ms() - ttl - 3_600_000)
            elif kind == "future":
                headers = operator.headers(topic.name, key, value, now_ms=now_ms() + 3_600_000)
            else:  # tampered: the signature is for other bytes (one more space) than those sent
                headers = operator.headers(topic.name, key, value + b" ")
        forged[send(topic, key, value, headers)] = f"{topic.name.rsplit('.', 1)[-1]}:{kind}"
    producer.close()

    def rejected() -> set[Where]:
        dead.poll(500)
        return {
            w
            for w, ds in _dead_letters(dead).items()
            if w in forged and any(d.stage == "auth" or "authentic" in d.reason for d in ds)
        }

    refused: set[Where] = set()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and len(refused) < len(forged):
        refused = rejected()
    # Effects a forged record would have had, looked for directly.
    effects: list[str] = []  # besides accepted decisions
    in_store = [i for i in forged_ids if progress.get(i) is not None]
    current = progress.spec(job)
    if current is None or current.topology.num_machines != 4:
        effects.append(f"job spec replaced: {current.topology.num_machines if current else None} machines")
    beats = TopicReader(stack, [HEARTBEATS])
    t_beats = time.monotonic()
    beats.drain(8)
    beats_s = time.monotonic() - t_beats  # 8 s, more while other exporters' beats keep coming
    n_beats = len(beats.events(Heartbeat, lambda h: h.node == node))
    beats.close()
    res.extra["exporter_heartbeats"] = n_beats
    res.extra["exporter_heartbeats_over_s"] = round(beats_s, 1)
    # Its interval is 2 s (0.5 a second); the forged command would make it 0.1 s (10 a second).
    if n_beats > beats_s:
        effects.append(f"exporter heartbeat interval changed ({n_beats} in {beats_s:.0f} s)")
    res.extra["worker_dedup_probe_decisions"] = dup = _dedup_probe(stack, job)
    if dup != 1:
        effects.append(f"worker de-duplication changed ({dup} decisions for one repeated Xid)")
    evictions = [c for c in svc.executor_calls() if c["call"] == "evict" and c["job"] == job]
    progress.close()
    alive = {p.name: p.alive() for p in (worker, svc, exporter)}
    by_kind = Counter(forged.values())
    unrefused = Counter(forged[w] for w in forged if w not in refused)
    res.produced = len(forged)
    res.stored = None
    res.lost = None
    res.duplicated = None
    res.accepted_forged = len(in_store) + len(effects)
    res.decisions_expected, res.decisions_made, res.decisions_acted = 1, 1, len(evictions)
    res.extra.update(
        forged_by_kind=dict(by_kind),
        dead_lettered_at_auth=len(refused),
        not_dead_lettered=dict(unrefused),
    )
    res.note(f"{len(forged)} forged records, {len(refused)} dead-lettered at the signature check")
    if in_store or effects:
        res.note("accepted: " + "; ".join([f"{len(in_store)} forged decision(s)", *effects]))
    if unrefused:
        res.note(f"no auth dead letter for: {dict(unrefused)}")
    if c0_at is None:
        res.note("the exporter never confirmed a command (its forged commands may be unread)")
    dead_procs = [n for n, ok in alive.items() if not ok]
    if dead_procs:
        res.note(f"died: {', '.join(dead_procs)}")
    res.passed = (
        not in_store
        and not effects
        and not unrefused
        and not dead_procs
        and len(evictions) == 1
        and c0_at is not None
    )
    dead.close()
    for p in (exporter, worker, svc):
        p.stop()
    return res


def _exporter_command(
    stack: ChaosStack,
    operator: Signer,
    node: str,
    send: Callable[[Topic, bytes | None, bytes | None, Any], Where],
    originals: dict[str, tuple[bytes, bytes, Any]],
) -> Where | None:
    """Send authentic (harmless) commands until the exporter commits past one: its listener has
    joined and read it.  That last one is the original the forger replays."""
    from kafka import KafkaConsumer, TopicPartition

    group = KafkaConsumer(
        **stack.settings.kafka.client_kwargs(),
        group_id=f"trainguard-exporter.{node}",
        enable_auto_commit=False,
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            c0 = Command(
                command_id=unique("c0"),
                ts_ms=now_ms(),
                kind=CommandKind.SET_INTERVAL,
                node=node,
                args={"source": "heartbeat", "interval_s": 2.0},
            )
            rec = _signed(operator, COMMANDS, c0)
            at = send(COMMANDS, *rec)
            tp = TopicPartition(at[0], at[1])
            for _ in range(20):
                committed = group.committed(tp)
                if committed is not None and committed > at[2]:
                    originals[COMMANDS.name] = rec
                    return at
                time.sleep(0.5)
        return None
    finally:
        group.close()


#: what a forged control command tries to turn off (the probe below shows it if both got through).
_INCIDENT_PATHS = ("decide.incident_max_s", "decide.settle_s")


def _dedup_probe(stack: ChaosStack, job: str) -> int:
    """The same Xid on one node twice, 1 s apart: decisions made (1 while they are one incident)."""
    from trainguard.schemas.topics import DECISIONS as DEC

    reader = TopicReader(stack, [DEC])
    node = unique(f"{job}-dedup")
    for _ in range(2):
        stack.send(LogLine(node=node, ts_ms=now_ms(), source="kernel", line=XID_79, job=job))
        time.sleep(1)
    reader.drain(8)
    n = len({d.decision_id for d in reader.events(Decision, lambda d: node in d.targets.machines)})
    reader.close()
    return n
