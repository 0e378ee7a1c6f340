"""Stream worker integration tests on the real broker and ClickHouse (issue: streams)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.streams.harness import Watcher, WorkerProcess, send, unique
from tests.waiting import wait_until
from trainguard.detectors.decide import DecideConfig
from trainguard.detectors.flight_recorder import dump_to_event, load_dump_dir
from trainguard.detectors.stacks import DumpName, DumpParser
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.config import Settings
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.control import Command, CommandKind, Decision, Detection, JobSpec
from trainguard.schemas.enums import Action, ProcessRole
from trainguard.schemas.telemetry import NicSample, NicSampleBatch
from trainguard.schemas.topics import COMMANDS, DECISIONS, DETECTIONS, JOBS, TOPICS
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.workload import (
    FlightRecorderDump,
    Frame,
    LogLine,
    RankLiveness,
    StackDump,
    ThreadStack,
    TrainingStep,
)

pytestmark = pytest.mark.slow
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "stacks"
FR_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "flight_recorder"
XID = "[ 8123.456789] NVRM: Xid (PCI:0000:3b:00): {code}, pid=4242, name=python, GPU has fallen off the bus."


def _store(settings: Settings) -> ClickHouseStore:
    return ClickHouseStore(settings.clickhouse)


def _rows(st: ClickHouseStore, table: str, where: str, params: dict[str, str], n: int) -> None:
    """Until ``table`` holds exactly ``n`` rows matching ``where`` (the sink stores in batches)."""
    wait_until(lambda: st.count(table, where, params) == n, 20, f"{n} rows in {table} where {where} {params}")


def test_xid_79_line_evicts_that_machine(stack_settings: Settings, worker: WorkerProcess) -> None:
    job, node = unique("xid"), unique("node")
    w = Watcher(stack_settings, DECISIONS)
    send(
        stack_settings,
        LogLine(node=node, ts_ms=now_ms(), source="kernel", line=XID.format(code=79), seq=7, job=job),
    )
    dec = w.wait_for(lambda e: isinstance(e, Decision) and e.job == job)
    assert isinstance(dec, Decision)
    assert (
        dec.action is Action.EVICT and dec.targets.machines == [node] and dec.targets.group_kind == "machine"
    )
    w.close()
    st = _store(stack_settings)
    _rows(st, "decisions", "decision_id = %(d)s", {"d": dec.decision_id}, 1)
    _rows(st, "log_lines", "node = %(n)s", {"n": node}, 1)
    _rows(st, "detections", "job = %(j)s AND kind = 'xid-79'", {"j": job}, 1)


def test_nan_loss_asks_for_stop_time_diagnosis(stack_settings: Settings, worker: WorkerProcess) -> None:
    job = unique("nan")
    w = Watcher(stack_settings, DECISIONS)
    t0 = now_ms()
    steps = [
        TrainingStep(
            job=job, rank=r, step=s, ts_ms=t0 + s * 100, node="n0", loss=3.0 - 0.01 * s, grad_norm=1.0
        )
        for s in range(12)
        for r in range(2)
    ]
    steps.append(
        TrainingStep(job=job, rank=1, step=12, ts_ms=t0 + 1300, node="n0", loss=float("nan"), grad_norm=1.0)
    )
    send(stack_settings, *steps)
    dec = w.wait_for(lambda e: isinstance(e, Decision) and e.job == job and e.action is Action.DIAGNOSE)
    assert isinstance(dec, Decision)
    assert dec.evidence["detection"]["kind"] == "nan" and dec.evidence["detection"]["ranks"] == [1]
    w.close()
    st = _store(stack_settings)
    _rows(st, "training_steps", "job = %(j)s", {"j": job}, 25)
    _rows(st, "decisions", "decision_id = %(d)s", {"d": dec.decision_id}, 1)


def test_user_type_error_traceback_rolls_back_code(stack_settings: Settings, worker: WorkerProcess) -> None:
    job, node = unique("tb"), unique("node")
    tb = [
        "[rank3]: Traceback (most recent call last):",
        '[rank3]:   File "/workspace/megatron/train.py", line 212, in <module>',
        "[rank3]:     main()",
        '[rank3]:   File "/workspace/megatron/model/new_attention.py", line 88, in forward',
        "[rank3]:     scores = q @ k.transpose(-1, -2) * self.scale",
        "[rank3]: TypeError: unsupported operand type(s) for *: 'Tensor' and 'NoneType'",
    ]
    t0 = now_ms()
    w = Watcher(stack_settings, DECISIONS)
    send(
        stack_settings,
        *[
            LogLine(node=node, ts_ms=t0 + i, source="stderr", line=line, seq=i, job=job, rank=3)
            for i, line in enumerate(tb)
        ],
    )
    dec = w.wait_for(lambda e: isinstance(e, Decision) and e.job == job)
    assert isinstance(dec, Decision) and dec.action is Action.ROLLBACK
    w.close()
    st = _store(stack_settings)
    rows = wait_until(
        lambda: st.query("SELECT evidence FROM detections FINAL WHERE job = %(j)s", {"j": job}),
        20,
        f"the detection of job {job} in ClickHouse",
    )
    assert "new_attention.py" in rows[0][0] and "TypeError" in rows[0][0]


def test_nic_flap_once_is_tolerated_twice_in_five_minutes_evicts(
    stack_settings: Settings, worker: WorkerProcess
) -> None:
    job, node = unique("nic"), unique("node")
    w = Watcher(stack_settings, DECISIONS)
    d = Watcher(stack_settings, DETECTIONS)
    t0 = now_ms()

    def nic(state: str, dt_s: int) -> NicSampleBatch:
        return NicSampleBatch(
            node=node,
            ts_ms=t0 + dt_s * 1000,
            job=job,
            nics=[NicSample(name="ib0", kind="ib", operstate=state, carrier=state == "up")],
        )

    send(stack_settings, nic("up", 0), nic("down", 30), nic("up", 60))
    d.wait_for(lambda e: isinstance(e, Detection) and e.node == node and e.kind == "nic-state-down")
    assert w.all(lambda e: isinstance(e, Decision) and e.job == job, settle_s=3.0) == []
    send(stack_settings, nic("down", 120))
    dec = w.wait_for(lambda e: isinstance(e, Decision) and e.job == job)
    assert isinstance(dec, Decision) and dec.action is Action.EVICT and dec.targets.machines == [node]
    w.close()
    d.close()


def _fixture_dumps(
    name: str, job: str, machines: list[str], rpm: int, capture_id: str
) -> dict[str, list[StackDump]]:
    """node -> StackDumps of its ranks, from a fixture captured with py-spy from a real gloo job."""
    parser = DumpParser()
    out: dict[str, list[StackDump]] = {}
    for f in sorted((FIXTURES / name).glob("rank*.json")):
        dn = DumpName.parse(f.name)
        assert dn is not None
        for pd in parser.parse(f.read_text(), "json", f.name, dn.pid):
            threads = [
                ThreadStack(
                    thread_id=t.thread_id or 0,
                    name=t.name,
                    active=bool(t.active),
                    frames=[Frame(fr.name, fr.filename, fr.line) for fr in t.frames],
                )
                for t in pd.threads
            ]
            node = machines[dn.rank // rpm]
            role = ProcessRole.MAIN if dn.worker is None else ProcessRole.DATALOADER
            out.setdefault(node, []).append(
                StackDump(
                    job=job,
                    node=node,
                    rank=dn.rank,
                    pid=pd.pid,
                    capture_id=capture_id,
                    ts_ms=now_ms(),
                    role=role,
                    threads=threads,
                )
            )
    return out


def test_stalled_rank_is_localised_and_its_pipeline_evicted(
    stack_settings: Settings, worker: WorkerProcess
) -> None:
    # tp2 pp2 dp2, 2 ranks per machine; the fixture's rank 5 hangs in compute (real py-spy dumps).
    job = unique("hang")
    machines = [f"{job}-m{i}" for i in range(4)]
    topo = JobTopology(job=job, tp=2, pp=2, dp=2, ranks_per_machine=2, machines=machines)
    commands, decisions = Watcher(stack_settings, COMMANDS), Watcher(stack_settings, DECISIONS)
    t0 = now_ms()
    send(stack_settings, JobSpec(job=job, ts_ms=t0, topology=topo))
    worker.wait_followed(stack_settings, JOBS)  # every worker follows the jobs topic into its job directory
    send(
        stack_settings,
        *[
            TrainingStep(job=job, rank=r, step=s, ts_ms=t0 + s * 200, node=machines[r // 2], loss=2.0)
            for s in range(3)
            for r in range(8)
        ],
    )
    # No more steps: after the stall threshold the worker suspects a hang and asks every machine for stacks.
    first = commands.wait_for(lambda e: isinstance(e, Command) and e.job == job, timeout_s=30)
    assert isinstance(first, Command) and first.kind is CommandKind.CAPTURE_STACKS
    cmds = [
        first,
        *commands.all(lambda e: isinstance(e, Command) and e.job == job and e is not first, settle_s=1.0),
    ]
    # Kafka delivery is at-least-once (a producer retry under load repeats a record): count by id.
    assert sorted({c.command_id: c.node for c in cmds if isinstance(c, Command)}.values()) == machines
    capture_id = str(first.args["capture_id"])
    # A hang's capture asks for the ranks' Flight Recorders too.
    assert all(c.args.get("flight_recorder") is True for c in cmds if isinstance(c, Command))
    started = time.monotonic()
    dumps = _fixture_dumps("tp2pp2dp2_compute_hang_last_stage", job, machines, 2, capture_id)
    fr = _fixture_fr("tp2pp2dp2_compute_hang", job, machines, 2, capture_id)
    send(stack_settings, *[d for node in machines for d in dumps[node]], *fr)
    dec = decisions.wait_for(
        lambda e: isinstance(e, Decision) and e.job == job and e.action is Action.EVICT, 30
    )
    # Judged on the last answer, not at the capture's 20 s deadline.
    assert time.monotonic() - started < 15
    assert isinstance(dec, Decision)
    assert dec.targets.group_kind == "pp" and dec.targets.ranks == [1, 5]
    assert dec.targets.machines == [machines[0], machines[2]]
    analysis = dec.evidence["analysis"]
    assert 5 in analysis["suspect_ranks"]
    # Both witnesses name rank 5: the stacks (real py-spy dumps) and the Flight Recorder (real
    # gloo dumps of a rank hung computing).
    assert analysis["decided_by"] == "both" and analysis["flight_recorder"]["suspect_ranks"] == [5]
    commands.close()
    decisions.close()
    st = _store(stack_settings)
    _rows(st, "stack_dumps", "job = %(j)s", {"j": job}, sum(map(len, dumps.values())))
    _rows(st, "flight_recorder_dumps", "job = %(j)s AND capture_id = %(c)s", {"j": job, "c": capture_id}, 8)
    _rows(st, "decisions", "job = %(j)s AND action = 'evict'", {"j": job}, 1)


def test_a_machine_that_falls_silent_is_evicted_without_a_capture(
    stack_settings: Settings, worker: WorkerProcess
) -> None:
    """Both machines' exporters send liveness; one machine freezes (nothing from it any more, no
    exit either) and the job stops: that machine is evicted from its silence alone."""
    job = unique("silent")
    machines = [f"{job}-m{i}" for i in range(2)]
    topo = JobTopology(job=job, tp=1, pp=1, dp=4, ranks_per_machine=2, machines=machines)
    commands, decisions = Watcher(stack_settings, COMMANDS), Watcher(stack_settings, DECISIONS)
    send(stack_settings, JobSpec(job=job, ts_ms=now_ms(), topology=topo))
    worker.wait_followed(stack_settings, JOBS)

    def beat(nodes: list[str], step: int | None) -> None:
        t = now_ms()
        events: list[Event] = [
            RankLiveness(
                job=job, node=n, ts_ms=t, ranks=[2 * i, 2 * i + 1], states=["S", "S"], interval_s=1.0
            )
            for i, n in enumerate(machines)
            if n in nodes
        ]
        if step is not None:
            events += [
                TrainingStep(job=job, rank=r, step=step, ts_ms=t, node=machines[r // 2], loss=2.0)
                for r in range(4)
            ]
        send(stack_settings, *events)

    for step in range(1, 4):
        beat(machines, step)
        time.sleep(1.0)
    frozen = time.monotonic()
    dec = None
    while time.monotonic() - frozen < 25 and dec is None:
        beat(machines[1:], None)  # m0 froze: only m1 speaks, and nobody steps
        time.sleep(1.0)
        found = decisions.all(lambda e: isinstance(e, Decision) and e.job == job)
        dec = found[0] if found else None
    assert isinstance(dec, Decision), "no decision within 25 s of the freeze"
    took = time.monotonic() - frozen
    assert (
        dec.action is Action.EVICT and dec.targets.machines == [machines[0]] and dec.targets.ranks == [0, 1]
    )
    assert dec.evidence["detection"]["kind"] == "machine_silent"
    # The bound: 3 of the node's 1 s intervals (this worker's floor is 2 s), + the 1 s check timer.
    assert took < 10, took
    assert not commands.all(lambda e: isinstance(e, Command) and e.job == job, settle_s=0.5)
    commands.close()
    decisions.close()
    _rows(
        _store(stack_settings),
        "rank_liveness",
        "job = %(j)s AND node = %(n)s",
        {"j": job, "n": machines[0]},
        3,
    )


def _fixture_fr(
    name: str, job: str, machines: list[str], rpm: int, capture_id: str
) -> list[FlightRecorderDump]:
    """The capture's Flight Recorder answers, from real gloo dumps (``scripts/capture_fr_fixtures.py``)."""
    manifest = json.loads((FR_FIXTURES / name / "manifest.json").read_text())
    dumped = manifest["dumped_at_ns"]["json"]
    return [
        dump_to_event(
            d, job=job, node=machines[r // rpm], ts_ms=dumped[str(r)] // 1_000_000, capture_id=capture_id
        )
        for r, d in load_dump_dir(FR_FIXTURES / name / "json").items()
    ]


def test_garbage_on_every_input_topic_is_dead_lettered(
    stack_settings: Settings, worker: WorkerProcess
) -> None:
    tag = unique("junk")
    raw = [
        (t.name, tag.encode(), b"\x00\xffnot an event") for t in TOPICS if t.name != "trainguard.deadletter"
    ]
    send(stack_settings, raw=raw)
    st = _store(stack_settings)
    wait_until(
        lambda: st.count("dead_letters", "key = %(k)s", {"k": tag}) == len(raw),
        30,
        f"{len(raw)} dead letters keyed {tag} in ClickHouse",
    )
    assert worker.healthz() is not None and worker.healthz()["ok"]  # type: ignore[index]
    assert 'trainguard_dead_letters_total{agent="sink"}' in worker.metrics()


def test_thresholds_change_at_runtime_through_the_control_topic(
    stack_settings: Settings, worker: WorkerProcess
) -> None:
    from trainguard.schemas.topics import CONTROL

    job = unique("ctl")
    w = Watcher(stack_settings, DECISIONS)

    def xid_pair(node: str, t0: int) -> list[LogLine]:
        return [
            LogLine(node=node, ts_ms=t0 + i * 1000, source="kernel", line=XID.format(code=79), seq=i, job=job)
            for i in range(2)
        ]

    def set_windows(settle_s: float, incident_max_s: float, t: int) -> None:
        for path, value in (("decide.settle_s", settle_s), ("decide.incident_max_s", incident_max_s)):
            send(
                stack_settings,
                Command(
                    command_id=unique("cmd"),
                    ts_ms=t,
                    kind=CommandKind.SET_THRESHOLD,
                    job=job,
                    args={"path": path, "value": value, "app_id": worker.app_id},
                ),
                topic=CONTROL,
            )

    # Defaults (no action service ends the incident: it stays open for 300 s): the same fault
    # twice 1 s apart is one decision.
    t0 = now_ms()
    send(stack_settings, *xid_pair(f"{job}-a", t0))
    w.wait_for(lambda e: isinstance(e, Decision) and e.job == job)
    ids = {e.decision_id for e in w.all(lambda e: isinstance(e, Decision) and e.job == job, settle_s=2.0)}  # type: ignore[attr-defined]
    assert len(ids) == 1  # distinct ids: a retried produce may repeat a record on the wire
    try:
        set_windows(0.0, 0.0, now_ms())
        worker.wait_followed(stack_settings, CONTROL)  # every worker follows the control topic on its own
        b = f"{job}-b"
        send(stack_settings, *xid_pair(b, now_ms()))

        def got() -> set[str]:
            mine = w.all(lambda e: isinstance(e, Decision) and e.job == job)
            return {e.decision_id for e in mine if isinstance(e, Decision) and e.targets.machines == [b]}

        wait_until(lambda: len(got()) == 2, 20, lambda: f"two decisions for {b} (got {got()})")
    finally:
        defaults = DecideConfig()  # the control topic is replayed by every later worker: restore
        set_windows(defaults.settle_s, defaults.incident_max_s, now_ms())
    # An invalid change is rejected and the worker keeps running with its last good config.
    bad = unique("cmd")
    send(
        stack_settings,
        Command(
            command_id=bad,
            ts_ms=now_ms(),
            kind=CommandKind.SET_THRESHOLD,
            job=job,
            args={"path": "decide.no_such_setting", "value": 1, "app_id": worker.app_id},
        ),
        topic=CONTROL,
    )
    worker.wait_followed(stack_settings, CONTROL)
    assert f"rejected control command {bad}" in worker.log.read_text(errors="replace")
    assert worker.healthz() is not None
    assert CONTROL.partitions == 1
    w.close()
