"""A real torch job (CPU, gloo, 2 ranks, a DataLoader worker each) under the exporter:
step telemetry reaches Kafka, and a capture command returns py-spy dumps of every rank and its
dataloader worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.net import free_port
from tests.waiting import wait_until
from trainguard.infra.bus import EventProducer, signer_for
from trainguard.infra.config import Settings
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.control import Command, CommandKind
from trainguard.schemas.enums import ProcessRole
from trainguard.schemas.topics import COMMANDS, STACKS, STEPS
from trainguard.schemas.workload import StackDump, TrainingStep
from trainguard.streams.exporter.config import load_exporter_config
from trainguard.streams.exporter.service import ExporterService

pytestmark = pytest.mark.slow

RANKS = 2
JOB_SCRIPT = Path(__file__).with_name("train_job.py")


# Two torch ranks started cold, then py-spy dumps of every process: its own waits allow up to about
# 400 s on a loaded host, more than the 300 s default.
@pytest.mark.timeout(600)
def test_torch_job_steps_and_stack_capture(stack_settings: Settings, tmp_path: Path) -> None:
    from tests.exporter.kafka_helpers import TopicReader

    job = f"torch-{uuid.uuid4().hex[:8]}"
    node = f"node-{job}"
    sock = tmp_path / "r.sock"
    cfg = load_exporter_config(
        {
            "node": node,
            "job": job,
            "state_dir": str(tmp_path / "state"),
            "nvml": {"enabled": False},
            "nic": {"enabled": False},
            "host": {"enabled": False},
            "kernel_log": {"enabled": False},
            "reporter": {"socket": str(sock), "interval_s": 0.2},
            "process": {"cmd_pattern": f"--tg-job {job}", "interval_s": 0.5},
            "stacks": {"parallel": 4},
        },
        environ={},
    )
    reader = TopicReader(stack_settings.kafka, [STEPS.name, STACKS.name])
    service = ExporterService(cfg, stack_settings.kafka)
    service.start()
    procs: list[subprocess.Popen[bytes]] = []
    port = free_port()
    try:
        for rank in range(RANKS):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(RANKS),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TRAINGUARD_JOB": job,
                "TRAINGUARD_REPORTER_SOCKET": str(sock),
                "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(JOB_SCRIPT), "--tg-job", job],
                    env=env,
                    start_new_session=True,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            )
        mine = lambda ev: getattr(ev, "job", None) == job  # noqa: E731

        def three_steps_each(got: list[Event]) -> bool:
            return all(
                sum(isinstance(e, TrainingStep) and e.rank == r for e in got) >= 3 for r in range(RANKS)
            )

        steps = reader.read_until(mine, three_steps_each, timeout_s=120)
        assert three_steps_each(steps), [p.poll() for p in procs]
        s = next(e for e in steps if isinstance(e, TrainingStep) and e.step_time_s)
        assert s.node == node and s.loss is not None and s.grad_norm is not None and s.tokens_per_s
        assert s.mfu is not None and 0 < s.mfu <= 1

        # every rank has its dataloader worker before we ask for stacks
        def workers_up() -> bool:
            found = service.stacks.discover()
            return sum(p.role is ProcessRole.DATALOADER for p in found) >= RANKS

        wait_until(workers_up, 60, "a dataloader worker of every rank", interval_s=0.2)
        assert service.commands is not None and service.commands.ready.wait(30)
        capture = uuid.uuid4().hex
        producer = EventProducer(stack_settings.kafka, signer=signer_for(stack_settings, "operator"))
        producer.send(
            Command(
                # The aggregator sends one command per machine, all under one capture id.
                command_id=f"{capture}-{node}",
                ts_ms=now_ms(),
                kind=CommandKind.CAPTURE_STACKS,
                node=node,
                args={"rounds": 1, "capture_id": capture},
            ),
            COMMANDS,
        ).get(timeout=30)
        producer.close()

        def dumped(got: list[Event]) -> bool:
            have = {(e.rank, e.role) for e in got if isinstance(e, StackDump) and e.capture_id == capture}
            return all(
                (r, role) in have for r in range(RANKS) for role in (ProcessRole.MAIN, ProcessRole.DATALOADER)
            )

        dumps = [e for e in reader.read_until(mine, dumped, timeout_s=120) if isinstance(e, StackDump)]
        assert dumped(dumps)  # type: ignore[arg-type]
        for d in dumps:
            if d.role in (ProcessRole.MAIN, ProcessRole.DATALOADER):
                assert not d.error and d.threads, (d.pid, d.error)
                assert d.job == job and d.node == node and d.round == 0
                assert {p.pid for p in d.process_tree} >= {d.pid}
        main0 = next(d for d in dumps if d.rank == 0 and d.role is ProcessRole.MAIN)
        funcs = {f.function for t in main0.threads for f in t.frames}
        assert "main" in funcs and "train_job.py" in main0.raw_text
        worker0 = next(d for d in dumps if d.rank == 0 and d.role is ProcessRole.DATALOADER)
        assert any("worker.py" in f.filename for t in worker0.threads for f in t.frames)
        assert {p.role for p in main0.process_tree} >= {ProcessRole.MAIN, ProcessRole.DATALOADER}
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait(30)
        service.stop()
        reader.close()
