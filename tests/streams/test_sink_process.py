"""The sink as a process of its own (``worker.sink_process`` + ``trainguard sink``), on the real
broker and ClickHouse: the worker decides without a sink thread, the sink process stores every
topic and dead-letters garbage exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.net import free_port
from tests.streams.conftest import FAST_ENV
from tests.streams.harness import Watcher, WorkerProcess, send, unique
from tests.waiting import wait_until
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.config import Settings
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import Decision
from trainguard.schemas.enums import Action
from trainguard.schemas.topics import DECISIONS, TOPICS
from trainguard.schemas.workload import LogLine

XID = "[ 8123.456789] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."
PROCESS_ENV = {**FAST_ENV, "TRAINGUARD__WORKER__SINK_PROCESS": "true"}


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class SinkProcess:
    """``trainguard sink`` for ``app_id`` in a subprocess, ready once it has stored a probe line."""

    def __init__(self, app_id: str, port: int, log: Path, settings: Settings) -> None:
        self.app_id, self.port, self.log, self.settings = app_id, port, log, settings
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> SinkProcess:
        exe = Path(sys.executable).with_name("trainguard")
        env = {**os.environ, **PROCESS_ENV, "TRAINGUARD__WORKER__AUTO_OFFSET_RESET": "latest"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [str(exe), "sink", "--app-id", self.app_id, "--web-port", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        store = ClickHouseStore(self.settings.clickhouse)

        def stored_a_probe() -> bool:  # a fresh probe each time: one sent before the group joined is lost
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"sink exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
                )
            # Up first (its signal handlers set): another test's worker may store the probe too.
            if "sink up" not in self.log.read_text():
                time.sleep(0.2)
                return False
            node = unique("sink-probe")
            send(
                self.settings, LogLine(node=node, ts_ms=now_ms(), source="kernel", line="probe", job="probe")
            )
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                if store.count("log_lines", "node = %(n)s", {"n": node}):
                    return True
                time.sleep(0.2)
            return False

        try:
            wait_until(stored_a_probe, 120, lambda: f"sink {self.app_id} to store a probe", interval_s=0)
        except BaseException:
            self.signal(signal.SIGKILL)
            raise
        finally:
            store.close()
        return self

    def signal(self, sig: int) -> int | None:
        """Send ``sig`` to the sink's process group and wait for it to end; its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        try:
            return self.proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(10)

    def healthz(self) -> dict[str, Any]:
        status, body = _get(self.port, "/healthz")
        return {"status": status, **json.loads(body)}

    def metrics(self) -> str:
        return _get(self.port, "/metrics")[1].decode()


@pytest.fixture(scope="module")
def pair(
    stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerProcess, SinkProcess]]:
    logs = Path(tmp_path_factory.mktemp("sink-process"))
    app_id = unique("tg-sinkproc")
    sink = SinkProcess(app_id, free_port(), logs / "sink.log", stack_settings).start()
    try:
        worker = WorkerProcess(app_id, free_port(), logs / "worker.log", PROCESS_ENV, stack_settings).start()
    except BaseException:
        sink.signal(signal.SIGKILL)
        raise
    yield worker, sink
    worker.stop()
    sink.signal(signal.SIGTERM)


@pytest.mark.slow
def test_the_worker_decides_and_the_sink_process_stores(
    stack_settings: Settings, pair: tuple[WorkerProcess, SinkProcess]
) -> None:
    worker, sink = pair
    job, node = unique("xid"), unique("node")
    watcher = Watcher(stack_settings, DECISIONS)
    send(stack_settings, LogLine(node=node, ts_ms=now_ms(), source="kernel", line=XID, seq=1, job=job))
    dec = watcher.wait_for(lambda e: isinstance(e, Decision) and e.job == job)
    watcher.close()
    assert isinstance(dec, Decision) and dec.action is Action.EVICT and dec.targets.machines == [node]
    store = ClickHouseStore(stack_settings.clickhouse)
    try:
        for table, where, params in [
            ("log_lines", "node = %(n)s", {"n": node}),
            ("decisions", "decision_id = %(d)s", {"d": dec.decision_id}),
            ("detections", "job = %(j)s AND kind = 'xid-79'", {"j": job}),
        ]:
            wait_until(
                lambda t=table, w=where, p=params: store.count(t, w, p) == 1,  # type: ignore[misc]
                20,
                f"one row in {table} {params}",
            )
    finally:
        store.close()
    # The worker runs no sink thread: no sink lag of its own, nothing stored under its name.
    health = worker.healthz()
    assert health is not None and health["ok"] and health["sink_lag"] is None
    assert 'agent="sink"' not in worker.metrics()
    # ... and the sink process reports what it stored, and is healthy.
    assert 'trainguard_agent_events_total{agent="sink"}' in sink.metrics()
    assert 'trainguard_sink_rows_total{table="log_lines"}' in sink.metrics()
    assert sink.healthz()["ok"] and sink.healthz()["status"] == 200
    assert _get(sink.port, "/nothing")[0] == 404


@pytest.mark.slow
def test_garbage_is_dead_lettered_once_by_the_sink_process(
    stack_settings: Settings, pair: tuple[WorkerProcess, SinkProcess]
) -> None:
    worker, sink = pair
    tag = unique("junk")
    raw = [
        (t.name, tag.encode(), b"\x00\xffnot an event") for t in TOPICS if t.name != "trainguard.deadletter"
    ]
    send(stack_settings, raw=raw)
    store = ClickHouseStore(stack_settings.clickhouse)
    try:
        count = lambda: store.count("dead_letters", "key = %(k)s", {"k": tag})  # noqa: E731
        wait_until(lambda: count() == len(raw), 30, f"{len(raw)} dead letters keyed {tag}")
        time.sleep(2)  # a second copy (the worker's agents dead-lettering too) would come by now
        assert count() == len(raw)
    finally:
        store.close()
    assert 'trainguard_dead_letters_total{agent="sink"}' in sink.metrics()
    health = worker.healthz()
    assert health is not None and health["ok"]


@pytest.mark.slow
def test_the_sink_process_stops_cleanly_on_sigterm(stack_settings: Settings, tmp_path: Path) -> None:
    sink = SinkProcess(unique("tg-sinkstop"), free_port(), tmp_path / "sink.log", stack_settings).start()
    assert sink.signal(signal.SIGTERM) == 0
    assert "sink stopped" in sink.log.read_text()


def test_a_shadow_namespace_has_no_sink_to_run() -> None:
    from trainguard.cli import main

    result = CliRunner().invoke(main, ["sink"], env={"TRAINGUARD__WORKER__TOPIC_NAMESPACE": "shadow"})
    assert result.exit_code == 2
    assert "never stored in ClickHouse" in result.output


def test_no_sink_runs_for_workers_configured_without_one() -> None:
    from trainguard.cli import main

    result = CliRunner().invoke(main, ["sink"], env={"TRAINGUARD__WORKER__SINK_ENABLED": "false"})
    assert result.exit_code == 2
    assert "worker.sink_enabled is false" in result.output
