"""The whole chain on a real Slurm: a decision on the real broker -> the action service (the CLI,
a real process) -> the ``slurm`` executor -> node drained, training step restarted on the spare
from the last checkpoint -> training goes on; and the service killed mid-recovery completes it
once when it comes back.  No mocks: private Slurm (``slurm_fixture``), the embedded Kafka."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.actions.conftest import make_decision, send
from tests.actions.slurm_fixture import TRAIN_PY, TrainingJob, ctx, spec, start_job
from tests.actions.slurm_fixture import slurm_cluster as slurm_cluster  # the fixture
from tests.streams.harness import Watcher
from trainguard.actions.executors.slurm import parse_record
from trainguard.infra.config import Settings
from trainguard.infra.stack.slurm import Slurm
from trainguard.schemas.control import ActionEvent, ActionPhase
from trainguard.schemas.enums import Action

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ACTIVE, SPARE = ["n1", "n2", "n3"], ["n4"]


@pytest.fixture
def job(slurm_cluster: Slurm, tmp_path: Path) -> Iterator[TrainingJob]:
    yield from start_job(slurm_cluster, tmp_path)


def _service(config: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "trainguard", "actions"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TRAINGUARD_CONFIG": str(config)},
            start_new_session=True,
        )


def _event(watch: Watcher, decision_id: str, step: str, phase: ActionPhase) -> list[ActionEvent]:
    return [
        e
        for e in watch.all(lambda e: isinstance(e, ActionEvent) and e.decision_id == decision_id)
        if isinstance(e, ActionEvent) and e.step == step and e.phase is phase
    ]


def _wait_event(
    watch: Watcher, decision_id: str, step: str, phases: set[ActionPhase], timeout_s: float
) -> None:
    watch.wait_for(
        lambda e: (
            isinstance(e, ActionEvent)
            and e.decision_id == decision_id
            and e.step == step
            and e.phase in phases
        ),
        timeout_s=timeout_s,
    )


def test_a_decision_drains_the_node_and_the_step_restarts_on_the_spare_once_across_a_service_kill(
    stack_settings: Settings, job: TrainingJob, tmp_path: Path, actions_watch: Watcher
) -> None:
    # The job trains on n1-n3 (started as its launcher would have: a step of the allocation).
    job.executor.restart(spec(job.name, ACTIVE, SPARE), ctx("start"))
    job.wait_progress("n2", 3)
    # Its ranks take 3 s to exit on SIGTERM, so the kill below lands inside the recovery's stop.
    (job.work / "slow-exit").write_text("3")

    state = tmp_path / "service-state"
    config = tmp_path / "tg.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "actions": {
                    "group_id": f"tg-actions-{job.name}",
                    "jobs": [job.name],
                    "state_dir": str(state),
                    "poll_interval_s": 0.2,
                    "executor": "slurm",
                    "executor_options": {
                        "slurm_conf": str(job.cluster.conf_file),
                        "step_command": [sys.executable, str(TRAIN_PY), str(job.work)],
                    },
                }
            }
        )
    )
    log = tmp_path / "service.log"
    proc = _service(config, log)
    send(stack_settings, spec(job.name, ACTIVE, SPARE))
    decision = make_decision(job.name, Action.EVICT, ["n2"])
    send(stack_settings, decision)
    try:
        # A loaded 2-core box starts the CLI slowly.
        _wait_event(actions_watch, decision.decision_id, "stop", {ActionPhase.STARTED}, timeout_s=150)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # mid-stop: the step's ranks are still exiting
        proc.wait(10)
    print(log.read_text()[-3000:])  # shown by pytest if anything below fails
    assert not _event(actions_watch, decision.decision_id, "recovery", ActionPhase.SUCCEEDED)
    at_kill = job.checkpoint()

    proc = _service(config, log)
    try:
        ended = {ActionPhase.SUCCEEDED, ActionPhase.FAILED, ActionPhase.HELD}
        _wait_event(actions_watch, decision.decision_id, "recovery", ended, timeout_s=150)
        # The spare trains from the checkpoint on (not from step 1): its first step is one past
        # the checkpoint it resumed from, which is at least what was saved at the kill; the new
        # step's rank 0 (n1) may not yet have saved that first step itself.
        first = job.wait_progress("n4", 0, timeout_s=60)
        # n4 took n2's place and with it n2's rank (1), not the last rank that Slurm's sorted
        # node order (n1, n3, n4) would give it: the parallel groups stay what the workers think.
        assert first[1] == "1", first
        assert at_kill < int(first[2]) <= job.checkpoint() + 1
        job.wait_progress("n4", int(first[2]) + 3)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0, log.read_text()[-2000:]

    # Completed once: one final event, one training step, on the new node list.
    finals = _event(actions_watch, decision.decision_id, "recovery", ActionPhase.SUCCEEDED)
    assert len({e.event_id for e in finals}) == 1, log.read_text()[-3000:]
    steps = job.training_steps()
    assert len(steps) == 1 and sorted(steps[0][2]) == ["n1", "n3", "n4"]
    # n2 drained, and `scontrol show node` says by which decision and for what.
    node = parse_record(job.sh("scontrol", "-o", "show", "node", "n2"))
    assert "DRAIN" in node["State"]
    assert node["Reason"].startswith(f"trainguard {decision.decision_id}:") and job.name in node["Reason"]
    # The action events say what was done in Slurm: the drain command and its exit code.
    evicted = _event(actions_watch, decision.decision_id, "evict", ActionPhase.SUCCEEDED)
    assert evicted and "scontrol update NodeName=n2 State=DRAIN" in evicted[-1].detail, evicted
    # The kill fell inside the stop: it ran again after the restart, and nothing after it twice.
    status = subprocess.run(
        [sys.executable, "-m", "trainguard", "actions", "status", "--json", "--job", job.name],
        env={**os.environ, "TRAINGUARD_CONFIG": str(config)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows = [json.loads(line) for line in status.stdout.splitlines()]
    assert [(r["decision_id"], r["state"]) for r in rows] == [(decision.decision_id, "succeeded")]
    attempts = {s["key"]: s["attempts"] for s in rows[0]["steps"]}
    assert attempts["stop"] == 2 and attempts["evict"] == 1 and attempts["restart"] == 1, attempts
