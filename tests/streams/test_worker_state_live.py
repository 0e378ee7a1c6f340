"""Worker state survives a restart and a rebalance (issue 11, item 9), on the real broker.

A NIC that flaps twice within 5 minutes is evicted; the first flap is seen by one worker, which
is then SIGKILLed, and the second by the workers of the same group that took over (one started
after the kill, a second one joining: a rebalance in the middle of the count window).  A job
whose ranks stop stepping is taken for hung by a worker that never saw one of its steps.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.net import free_ports
from tests.streams.harness import Watcher, WorkerProcess, send, unique
from tests.waiting import wait_until
from trainguard.infra.config import Settings
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import Decision
from trainguard.schemas.enums import Action
from trainguard.schemas.topics import DECISIONS
from trainguard.schemas.workload import LogLine, TrainingStep

pytestmark = pytest.mark.slow
LINK_DOWN = "[ 5521.118340] mlx5_core 0000:5e:00.0 ib0: Link down"


def state_writes(worker: WorkerProcess, stage: str) -> float:
    m = re.search(rf'^trainguard_state_writes_total\{{stage="{stage}"\}} (\S+)$', worker.metrics(), re.M)
    return float(m.group(1)) if m else 0.0


def link_down(job: str, nodes: list[str]) -> list[LogLine]:
    t = now_ms()
    return [LogLine(node=n, ts_ms=t, source="kernel", line=LINK_DOWN, job=job) for n in nodes]


@pytest.mark.timeout(900)
def test_a_count_window_survives_a_sigkill_and_a_rebalance(stack_settings: Settings, tmp_path: Path) -> None:
    app_id, job = unique("tg-state"), unique("state")
    nodes = [f"{job}-n{i}" for i in range(8)]  # spread over the partitions
    watcher = Watcher(stack_settings, DECISIONS)
    p1, p2, p3 = free_ports(3)
    # Production's default: partitions the killed worker never committed are replayed (so its
    # first flap is delivered again and must not count twice), not skipped.
    env = {"TRAINGUARD__WORKER__AUTO_OFFSET_RESET": "earliest"}
    first = WorkerProcess(app_id, p1, tmp_path / "w1.log", env, stack_settings).start()
    workers = [first]
    try:
        send(stack_settings, *link_down(job, nodes))  # flap 1: recorded, below the count
        wait_until(
            lambda: state_writes(first, "inspection") >= len(nodes),
            60,
            lambda: f"the first flap's windows in the changelog:\n{first.log_tail()}",
        )
        first.kill()  # SIGKILL: what reached the changelog is all that is left of its state
        workers.append(WorkerProcess(app_id, p2, tmp_path / "w2.log", env, stack_settings).start())
        # A second member joins: the partitions are split between the two (a rebalance).
        workers.append(WorkerProcess(app_id, p3, tmp_path / "w3.log", env, stack_settings).start())
        ours = lambda e: isinstance(e, Decision) and e.job == job  # noqa: E731
        assert watcher.all(ours, settle_s=2.0) == [], "the first flap alone (or redelivered) decided"

        send(stack_settings, *link_down(job, nodes))  # flap 2 within the window: evict each node
        wait_until(
            lambda: {m for e in watcher.all(ours) for m in e.targets.machines} >= set(nodes),  # type: ignore[union-attr]
            120,
            lambda: (
                f"evictions of {nodes}; saw {watcher.all(ours)}\n{workers[1].log_tail()}\n{workers[2].log_tail()}"
            ),
        )
        decisions = watcher.all(ours, settle_s=3.0)
        assert all(d.action is Action.EVICT for d in decisions)  # type: ignore[attr-defined]
        assert len({d.decision_id for d in decisions}) == len(nodes)  # type: ignore[attr-defined]
        restored = sum(
            float(v)
            for w in workers[1:]
            for v in re.findall(
                r'^trainguard_state_restores_total\{stage="inspection"\} (\S+)$', w.metrics(), re.M
            )
        )
        assert restored >= len(nodes)
    finally:
        for w in workers:
            w.kill()
        watcher.close()


@pytest.mark.timeout(600)
def test_a_hung_job_is_caught_by_a_worker_that_never_saw_its_steps(
    stack_settings: Settings, tmp_path: Path
) -> None:
    app_id, job = unique("tg-state-hang"), unique("hang")
    env = {
        "TRAINGUARD__WORKER__MONITOR__STALL__STALL_S": "8",
        "TRAINGUARD__WORKER__AUTO_OFFSET_RESET": "earliest",
    }
    watcher = Watcher(stack_settings, DECISIONS)
    p1, p2 = free_ports(2)
    first = WorkerProcess(app_id, p1, tmp_path / "w1.log", env=env, settings=stack_settings).start()
    second: WorkerProcess | None = None
    try:
        t = now_ms()
        for step in range(1, 4):
            send(
                stack_settings,
                *[
                    TrainingStep(job=job, rank=r, step=step, ts_ms=t + step * 100, node=f"{job}-m")
                    for r in range(4)
                ],
            )
        wait_until(
            lambda: state_writes(first, "training") >= 1,
            60,
            lambda: f"the job's monitor in the changelog:\n{first.log_tail()}",
        )
        first.kill()  # the ranks stop stepping too: nothing of the job reaches the next worker
        second = WorkerProcess(app_id, p2, tmp_path / "w2.log", env=env, settings=stack_settings).start()
        hang = watcher.wait_for(
            lambda e: isinstance(e, Decision) and e.job == job and e.action is Action.AGGREGATE, 120
        )
        assert "hang" in hang.evidence["detection"]["kind"]  # type: ignore[attr-defined]
    finally:
        first.kill()
        if second is not None:
            second.kill()
        watcher.close()
