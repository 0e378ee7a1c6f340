"""Worker failure: SIGKILL mid-stream loses no decision; ClickHouse down loses no row and stops
no detection."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests.net import free_ports
from tests.streams.harness import Watcher, WorkerProcess, send, unique
from tests.waiting import wait_until
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.config import Settings
from trainguard.infra.stack.clickhouse import ClickHouseServer
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import Decision, Detection, JobSpec
from trainguard.schemas.enums import Action
from trainguard.schemas.topics import DECISIONS, JOBS
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.workload import LogLine, TrainingStep

pytestmark = pytest.mark.slow
XID_79 = "[ 8123.456789] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."


# Two cold workers (start and first consumption allowed 150 s each), the stream, then every decision
# (180 s) and every row (30 s): its own waits allow up to about 600 s on a loaded CI box, so they,
# not the 300 s default, say what was late.
@pytest.mark.timeout(900)
def test_sigkill_mid_stream_then_a_new_worker_loses_no_decision(
    stack_settings: Settings, tmp_path: Path
) -> None:
    app_id, job = unique("tg-failover"), unique("failover")
    nodes = [f"{job}-n{i:03d}" for i in range(150)]
    watcher = Watcher(stack_settings, DECISIONS)
    # Production's default: a group without committed offsets starts from the earliest record, so a
    # partition the first worker never committed is replayed, not skipped.
    env = {"TRAINGUARD__WORKER__AUTO_OFFSET_RESET": "earliest"}
    port1, port2 = free_ports(2)
    first = WorkerProcess(app_id, port1, tmp_path / "w1.log", env, stack_settings).start()
    second = WorkerProcess(app_id, port2, tmp_path / "w2.log", env)
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

        def evicted() -> set[str]:
            return {
                m
                for e in watcher.all(lambda e: isinstance(e, Decision) and e.job == job)
                if isinstance(e, Decision) and e.action is Action.EVICT
                for m in e.targets.machines
            }

        wait_until(
            lambda: evicted() == set(nodes),
            180,
            lambda: f"an eviction of each machine; none yet for {sorted(set(nodes) - evicted())}",
        )
        st = ClickHouseStore(stack_settings.clickhouse)
        wait_until(
            lambda: st.count("decisions", "job = %(j)s", {"j": job}) >= len(nodes),
            30,
            f"{len(nodes)} decisions of job {job} in ClickHouse",
        )
        # Redelivered decisions carry the same ids: one row per machine, none lost, none doubled.
        assert st.count("decisions", "job = %(j)s", {"j": job}) == len(nodes)
    finally:
        stop.set()
        producer.join(60)
        first.kill()
        second.stop()
        watcher.close()


# A private ClickHouse (started twice, 30 s each), a cold worker (150 s), the detections while it is
# away and every row after (60 s): its own waits allow up to about 330 s, more than the 300 s default.
@pytest.mark.timeout(600)
def test_clickhouse_down_for_a_while_loses_no_row(stack_settings: Settings, tmp_path: Path) -> None:
    http_port, tcp_port, web_port = free_ports(3)
    stack_cfg = replace(
        stack_settings.stack, home=str(tmp_path), clickhouse_http_port=http_port, clickhouse_tcp_port=tcp_port
    )
    server = ClickHouseServer(stack_cfg)
    server.start()
    server.wait_healthy(30)
    store = ClickHouseStore(replace(stack_settings.clickhouse, port=http_port))
    store.migrate()
    env = {
        "TRAINGUARD__CLICKHOUSE__PORT": str(http_port),
        "TRAINGUARD__WORKER__SINK__RETRY_BACKOFF_MAX_S": "1",
        "TRAINGUARD__WORKER__SINK__MAX_WAIT_S": "0.2",
    }
    w = WorkerProcess(unique("tg-chdown"), web_port, tmp_path / "w.log", env, stack_settings).start()
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
        w.wait_followed(stack_settings, JOBS)  # the worker's job directory has it
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
        wait_until(
            lambda: store.count("training_steps", "job = %(j)s", {"j": job}) >= 400,
            60,
            f"the 400 steps of job {job} in ClickHouse once it is back",
        )
        assert store.count("training_steps", "job = %(j)s", {"j": job}) == 400
        wait_until(
            lambda: store.count("decisions", "decision_id = %(d)s", {"d": dec.decision_id}),
            60,
            f"decision {dec.decision_id} in ClickHouse once it is back",
        )
        assert store.count("decisions", "decision_id = %(d)s", {"d": dec.decision_id}) == 1
    finally:
        w.stop()
        server.stop()
