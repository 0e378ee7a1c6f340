"""Worker failure: SIGKILL mid-stream loses no decision; ClickHouse down loses no row and stops
no detection."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from infra.clickhouse.store import ClickHouseStore
from infra.config import Settings
from infra.stack.clickhouse import ClickHouseServer
from schemas.base import now_ms
from schemas.control import Decision, Detection, JobSpec
from schemas.enums import Action
from schemas.topics import DECISIONS
from schemas.topology import JobTopology
from schemas.workload import LogLine, TrainingStep
from tests.streams.harness import Watcher, WorkerProcess, send, unique

pytestmark = pytest.mark.slow
XID_79 = "[ 8123.456789] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."


def test_sigkill_mid_stream_then_a_new_worker_loses_no_decision(
    stack_settings: Settings, tmp_path: Path
) -> None:
    app_id, job = unique("tg-failover"), unique("failover")
    nodes = [f"{job}-n{i:03d}" for i in range(150)]
    watcher = Watcher(stack_settings, DECISIONS)
    # Production's default: a group without committed offsets starts from the earliest record, so a
    # partition the first worker never committed is replayed, not skipped.
    env = {"TRAINGUARD__WORKER__AUTO_OFFSET_RESET": "earliest"}
    first = WorkerProcess(app_id, 16191, tmp_path / "w1.log", env, stack_settings).start()
    second = WorkerProcess(app_id, 16192, tmp_path / "w2.log", env)
    stop = threading.Event()

    def produce() -> None:  # a steady stream of machine faults, one machine each
        for i, node in enumerate(nodes):
            if stop.is_set():
                return
            send(
                stack_settings,
                LogLine(node=node, ts_ms=now_ms(), source="kernel", line=XID_79, seq=i, job=job),
            )
            time.sleep(0.02)

    producer = threading.Thread(target=produce)
    try:
        producer.start()
        watcher.wait_for(lambda e: isinstance(e, Decision) and e.job == job, 30)
        first.kill()  # SIGKILL: no clean shutdown, no final commit
        producer.join(60)
        second.start()
        deadline = time.monotonic() + 180
        evicted: set[str] = set()
        while time.monotonic() < deadline and len(evicted) < len(nodes):
            evicted = {
                m
                for e in watcher.all(lambda e: isinstance(e, Decision) and e.job == job)
                if isinstance(e, Decision) and e.action is Action.EVICT
                for m in e.targets.machines
            }
            time.sleep(0.5)
        assert evicted == set(nodes)
        st = ClickHouseStore(stack_settings.clickhouse)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and st.count("decisions", "job = %(j)s", {"j": job}) < len(nodes):
            time.sleep(0.5)
        # Redelivered decisions carry the same ids: one row per machine, none lost, none doubled.
        assert st.count("decisions", "job = %(j)s", {"j": job}) == len(nodes)
    finally:
        stop.set()
        producer.join(60)
        first.kill()
        second.stop()
        watcher.close()


def test_clickhouse_down_for_a_while_loses_no_row(stack_settings: Settings, tmp_path: Path) -> None:
    stack_cfg = replace(
        stack_settings.stack, home=str(tmp_path), clickhouse_http_port=29523, clickhouse_tcp_port=29524
    )
    server = ClickHouseServer(stack_cfg)
    server.start()
    server.wait_healthy(30)
    store = ClickHouseStore(replace(stack_settings.clickhouse, port=29523))
    store.migrate()
    env = {
        "TRAINGUARD__CLICKHOUSE__PORT": "29523",
        "TRAINGUARD__WORKER__SINK__RETRY_BACKOFF_MAX_S": "1",
        "TRAINGUARD__WORKER__SINK__MAX_WAIT_S": "0.2",
    }
    w = WorkerProcess(unique("tg-chdown"), 16193, tmp_path / "w.log", env, stack_settings).start()
    job = unique("chdown")
    try:
        server.stop()
        t0 = now_ms()
        send(
            stack_settings,
            *[TrainingStep(job=job, rank=i % 8, step=i // 8, ts_ms=t0 + i, loss=1.0) for i in range(400)],
        )
        # The sink has a consumer group of its own: detection goes on while ClickHouse is away.
        node = unique("node")
        decisions = Watcher(stack_settings, DECISIONS)
        send(stack_settings, LogLine(node=node, ts_ms=now_ms(), source="kernel", line=XID_79, job=job))
        dec = decisions.wait_for(lambda e: isinstance(e, Decision) and e.job == job, 20)
        decisions.close()
        assert isinstance(dec, Decision) and dec.targets.machines == [node]
        # Job specs reach the worker from the jobs topic, not through ClickHouse: a rank-level
        # eviction is localised to its machine while the store is away.
        machines = [f"{job}-m0", f"{job}-m1"]
        topo = JobTopology(job=job, tp=2, pp=1, dp=1, ranks_per_machine=1, machines=machines)
        decisions = Watcher(stack_settings, DECISIONS)
        send(stack_settings, JobSpec(job=job, ts_ms=now_ms(), topology=topo))
        time.sleep(1.0)
        rank_fault = Detection(
            detection_id=unique("det"),
            ts_ms=now_ms(),
            job=job,
            kind="test-rank-fault",
            category="gpu_unavailable",
            action=Action.EVICT,
            ranks=[1],
            source_ts_ms=now_ms(),
        )
        send(stack_settings, rank_fault)
        evict = decisions.wait_for(
            lambda e: isinstance(e, Decision) and e.job == job and e.targets.ranks == [1], 20
        )
        decisions.close()
        assert isinstance(evict, Decision) and evict.targets.machines == [machines[1]]
        time.sleep(4)  # inserts fail and are retried; offsets stay uncommitted
        health = w.healthz()
        assert health is not None and health["ok"]  # the worker stays up and healthy
        failures = re.search(r"^trainguard_sink_failures_total (\S+)$", w.metrics(), re.M)
        assert failures is not None and float(failures.group(1)) > 0
        server.start()
        server.wait_healthy(30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and store.count("training_steps", "job = %(j)s", {"j": job}) < 400:
            time.sleep(0.5)
        assert store.count("training_steps", "job = %(j)s", {"j": job}) == 400
        while time.monotonic() < deadline and not store.count("decisions", "job = %(j)s", {"j": job}):
            time.sleep(0.5)
        assert store.count("decisions", "decision_id = %(d)s", {"d": dec.decision_id}) == 1
    finally:
        w.stop()
        server.stop()
