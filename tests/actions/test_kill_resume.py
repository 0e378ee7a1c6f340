"""Done-when: killing the action service (SIGKILL) mid-recovery and restarting it completes that
recovery exactly once.  The service runs as a real process (the CLI), the broker is real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.actions.conftest import job_spec, make_decision
from tests.streams.harness import Watcher, send, unique
from tests.waiting import wait_until
from trainguard.actions.config import ActionsConfig
from trainguard.actions.progress import ProgressStore
from trainguard.actions.state import RecoveryState
from trainguard.infra.bus import EventProducer, signer_for
from trainguard.infra.config import Settings
from trainguard.schemas.control import ActionEvent, ActionPhase, JobSpec
from trainguard.schemas.enums import Action

pytestmark = pytest.mark.slow


def start(config: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "trainguard", "actions", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TRAINGUARD_CONFIG": str(config)},
            start_new_session=True,
        )


class CommittedOffsets:
    """Reads a consumer group's committed offsets (without joining the group)."""

    def __init__(self, settings: Settings, group: str) -> None:
        from kafka import KafkaConsumer

        self.consumer = KafkaConsumer(
            **settings.kafka.client_kwargs(), group_id=group, enable_auto_commit=False
        )

    def past(self, topic: str, partition: int, offset: int) -> bool:
        from kafka import TopicPartition

        committed = self.consumer.committed(TopicPartition(topic, partition))
        return committed is not None and committed > offset

    def close(self) -> None:
        self.consumer.close()


# Two cold starts of the action service CLI around a kill: its own waits allow up to about 500 s on
# a loaded CI box, so they, not the suite's 300 s default, say what was late.
@pytest.mark.timeout(600)
def test_sigkill_mid_recovery_then_restart_completes_it_once(
    stack_settings: Settings, tmp_path: Path, actions_watch: Watcher, jobs_watch: Watcher
) -> None:
    job = unique("job-kill")
    group = unique("tg-actions-kill")
    state = tmp_path / "state"
    config = tmp_path / "tg.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "actions": {
                    "group_id": group,
                    "jobs": [job],
                    "state_dir": str(state),
                    "poll_interval_s": 0.2,
                    "executor": "dry_run",
                    # slow steps so the kill lands inside the recovery
                    "executor_options": {"delays": {"evict": 1.0, "activate_standbys": 3.0, "restart": 1.0}},
                }
            }
        )
    )
    log = tmp_path / "service.log"
    proc = start(config, log)
    spec = job_spec(job, n=4, standbys=2)
    send(stack_settings, spec)
    d = make_decision(job, Action.EVICT, [f"{job}-n1"])
    send(stack_settings, d)

    def seen(step: str, phase: ActionPhase) -> bool:
        return any(
            isinstance(e, ActionEvent)
            and e.decision_id == d.decision_id
            and e.step == step
            and e.phase is phase
            for e in actions_watch.seen
        )

    try:
        actions_watch.wait_for(
            lambda e: (
                isinstance(e, ActionEvent) and e.step == "swap_standbys" and e.phase is ActionPhase.STARTED
            ),
            timeout_s=150,  # generous: a loaded 2-core CI box starts the CLI slowly
        )
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # mid-swap: evict done, standbys being activated
        proc.wait(10)
        print(log.read_text()[-3000:])  # shown by pytest if anything below fails
    assert not seen("recovery", ActionPhase.SUCCEEDED)

    proc = start(config, log)
    try:
        done = actions_watch.wait_for(
            lambda e: (
                isinstance(e, ActionEvent)
                and e.decision_id == d.decision_id
                and e.step == "recovery"
                and e.phase is ActionPhase.SUCCEEDED
            ),
            timeout_s=150,  # generous: a loaded 2-core CI box starts the CLI slowly
        )
        assert isinstance(done, ActionEvent)
        # Redelivered after the restart: a no-op, once the service has consumed (committed) it.
        producer = EventProducer(stack_settings.kafka, signer=signer_for(stack_settings, "operator"))
        again = producer.send(d).get(timeout=30)
        producer.close()
        offsets = CommittedOffsets(stack_settings, ActionsConfig(group_id=group, jobs=[job]).consumer_group)
        try:
            wait_until(
                lambda: offsets.past(again.topic, again.partition, again.offset),
                60,
                lambda: f"the service to commit the redelivered decision; log:\n{log.read_text()[-2000:]}",
                interval_s=0.3,
            )
        finally:
            offsets.close()
        status = subprocess.run(
            [sys.executable, "-m", "trainguard", "actions", "status", "--json", "--job", job],
            env={**os.environ, "TRAINGUARD_CONFIG": str(config)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0, log.read_text()[-2000:]

    rows = [json.loads(line) for line in status.stdout.splitlines()]
    assert [(r["decision_id"], r["state"]) for r in rows] == [(d.decision_id, "succeeded")]
    swap = next(s for s in rows[0]["steps"] if s["key"] == "swap_standbys")
    assert swap["attempts"] == 2  # the step in flight at the kill ran again, nothing else did

    calls = [json.loads(x) for x in (state / "executor" / "dry_run.jsonl").read_text().splitlines()]
    kinds = [c["call"] for c in calls if c["job"] == job]
    assert kinds.count("evict") == 1 and kinds.count("stop") == 1 and kinds.count("restart") == 1
    assert kinds.count("activate_standbys") == 1  # killed before the first activation finished

    finals = {
        e.event_id
        for e in actions_watch.all(lambda e: isinstance(e, ActionEvent) and e.decision_id == d.decision_id)
        if isinstance(e, ActionEvent) and e.step == "recovery" and e.phase is ActionPhase.SUCCEEDED
    }
    assert len(finals) == 1
    spec_after = jobs_watch.wait_for(
        lambda e: isinstance(e, JobSpec) and e.job == job and e.ts_ms > spec.ts_ms
    )
    assert isinstance(spec_after, JobSpec) and f"{job}-warm0" in spec_after.topology.machines

    store = ProgressStore(state / "progress.sqlite")
    rec = store.get(d.decision_id)
    assert rec is not None and rec.state is RecoveryState.SUCCEEDED and rec.path == "evict"
    store.close()
