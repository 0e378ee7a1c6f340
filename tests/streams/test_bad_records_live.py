"""A real worker moves past bad control commands (integration, slow: the real broker and a
``trainguard worker`` process)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.streams.harness import Watcher, WorkerProcess, send, unique
from tests.waiting import wait_until
from trainguard.detectors.decide import DecideConfig
from trainguard.infra.config import Settings
from trainguard.schemas.base import now_ms
from trainguard.schemas.codec import encode
from trainguard.schemas.control import Command, CommandKind, DeadLetter, Decision
from trainguard.schemas.topics import CONTROL, DEAD_LETTERS, DECISIONS
from trainguard.schemas.workload import LogLine

pytestmark = pytest.mark.slow
XID = "[ 8123.456789] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."


def _command(job: str, app_id: str, path: str, value: Any) -> Command:
    return Command(
        command_id=unique("cmd"),
        ts_ms=now_ms(),
        kind=CommandKind.SET_THRESHOLD,
        job=job,
        args={"path": path, "value": value, "app_id": app_id},
    )


def test_a_poison_control_command_is_dead_lettered_and_the_next_one_applied(
    stack_settings: Settings, worker: WorkerProcess
) -> None:
    job = unique("ctl-bad")
    poison = _command(job, worker.app_id, "decide.no_such_setting", 1)  # decodes; cannot be applied
    huge = b'{"schema":"command","version":1,"n":' + b"1" * 4301 + b"}"  # does not decode
    # Both windows off (no action service here ends an incident): each report is its own.
    valid = [_command(job, worker.app_id, path, 0.0) for path in ("decide.settle_s", "decide.incident_max_s")]
    decisions, dead = Watcher(stack_settings, DECISIONS), Watcher(stack_settings, DEAD_LETTERS)
    try:
        send(
            stack_settings,
            raw=[(CONTROL.name, job.encode(), encode(poison)), (CONTROL.name, job.encode(), huge)],
        )
        send(stack_settings, *valid, topic=CONTROL)
        worker.wait_followed(stack_settings, CONTROL)
        # The valid commands are in force: the same fault twice 1 s apart is now two decisions.
        node, t0 = f"{job}-a", now_ms()
        lines = [
            LogLine(node=node, ts_ms=t0 + i * 1000, source="kernel", line=XID, seq=i, job=job)
            for i in range(2)
        ]
        send(stack_settings, *lines)

        def ids() -> set[str]:
            mine = decisions.all(lambda e: isinstance(e, Decision) and e.job == job)
            return {e.decision_id for e in mine if isinstance(e, Decision)}

        wait_until(lambda: len(ids()) == 2, 30, lambda: f"two decisions for {job} (got {ids()})")
    finally:
        defaults = DecideConfig()  # the control topic is replayed by every later worker: restore
        restore = [("decide.settle_s", defaults.settle_s), ("decide.incident_max_s", defaults.incident_max_s)]
        send(stack_settings, *(_command(job, worker.app_id, p, v) for p, v in restore), topic=CONTROL)
        decisions.close()
    # The poison is dead-lettered with its stage and coordinates, on the dead-letter topic (read
    # from Kafka: the worker's fresh sink group may have joined after the records were produced).
    try:
        dl = dead.wait_for(
            lambda e: (
                isinstance(e, DeadLetter) and e.stage == "worker:control" and poison.command_id in e.payload
            ),
            30,
        )
    finally:
        dead.close()
    assert isinstance(dl, DeadLetter) and dl.topic == CONTROL.name and dl.key == job and dl.offset >= 0
    assert f"rejected control command {poison.command_id}" in worker.log.read_text(errors="replace")
    health = worker.healthz()
    assert health is not None and health["ok"]
    assert 'trainguard_dead_letters_total{agent="control"}' in worker.metrics()
