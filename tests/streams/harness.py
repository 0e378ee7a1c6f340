"""Test harness for stream workers: a real `trainguard worker` process, a producer and a watcher.

Nothing is mocked: the worker is the real CLI in a subprocess, against the real broker and
ClickHouse of the local stack.  Each test uses its own job/node names, so tests share a worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra.bus import EventProducer
from infra.config import Settings
from schemas.base import Event
from schemas.codec import DecodeError, decode
from schemas.control import Decision
from schemas.topics import Topic


class WorkerProcess:
    """``trainguard worker`` as a subprocess with its own app id, web port and settings."""

    def __init__(
        self,
        app_id: str,
        web_port: int,
        log: Path,
        env: dict[str, str] | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.app_id, self.web_port, self.log = app_id, web_port, log
        # A new group starts at the end of the topics: the stack's history (earlier tests) is not
        # this worker's business.  A group with committed offsets (failover) resumes from them.
        self.env = {**os.environ, "TRAINGUARD__WORKER__AUTO_OFFSET_RESET": "latest", **(env or {})}
        self.settings = settings
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 150.0) -> WorkerProcess:
        exe = Path(sys.executable).with_name("trainguard")
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    str(exe),
                    "worker",
                    "--app-id",
                    self.app_id,
                    "--web-port",
                    str(self.web_port),
                    "--loglevel",
                    "warning",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"worker exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
                )
            if self.healthz() is not None:
                break
            time.sleep(0.3)
        else:
            raise RuntimeError(f"worker not up after {timeout_s} s:\n{self.log.read_text()[-3000:]}")
        if self.settings is not None:
            self._wait_until_consuming(self.settings, deadline)
        return self

    def _wait_until_consuming(self, settings: Settings, deadline: float) -> None:
        """Probe with an Xid line until its decision comes back: the group has joined and consumes."""
        from schemas.base import now_ms
        from schemas.topics import DECISIONS
        from schemas.workload import LogLine

        watcher = Watcher(settings, DECISIONS)
        line = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus."
        try:
            while time.monotonic() < deadline:
                node = unique("probe")
                send(settings, LogLine(node=node, ts_ms=now_ms(), source="kernel", line=line, job="probe"))

                def answered(e: Event, node: str = node) -> bool:
                    return isinstance(e, Decision) and e.job == "probe" and node in e.targets.machines

                try:
                    watcher.wait_for(answered, 3.0)
                    return
                except AssertionError:
                    continue
            raise RuntimeError(
                f"worker {self.app_id} never consumed a probe:\n{self.log.read_text()[-3000:]}"
            )
        finally:
            watcher.close()

    def healthz(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/healthz", timeout=1) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/metrics", timeout=2) as r:
            return r.read().decode()

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


class Watcher:
    """Reads a topic from its current end (no group) and keeps every decoded event."""

    def __init__(self, settings: Settings, topic: Topic) -> None:
        from kafka import KafkaConsumer, TopicPartition

        self.consumer = KafkaConsumer(
            **settings.kafka.client_kwargs(), group_id=None, enable_auto_commit=False
        )
        parts = [TopicPartition(topic.name, p) for p in range(topic.partitions)]
        self.consumer.assign(parts)
        self.consumer.seek_to_end(*parts)
        for tp in parts:  # resolve the end positions now, before the test produces anything
            self.consumer.position(tp)
        self.seen: list[Event] = []

    def poll(self) -> None:
        for recs in self.consumer.poll(timeout_ms=200).values():
            for r in recs:
                with contextlib.suppress(DecodeError):  # garbage is the dead-letter tests' business
                    self.seen.append(decode(r.value))

    def wait_for(self, pred: Callable[[Event], bool], timeout_s: float = 30.0) -> Event:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for ev in self.seen:
                if pred(ev):
                    return ev
            self.poll()
        raise AssertionError(f"no matching event within {timeout_s}s; saw {len(self.seen)}: {self.seen[-5:]}")

    def all(self, pred: Callable[[Event], bool], settle_s: float = 0.0) -> list[Event]:
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            self.poll()
        self.poll()
        return [e for e in self.seen if pred(e)]

    def close(self) -> None:
        self.consumer.close()


def send(
    settings: Settings,
    *events: Event,
    raw: list[tuple[str, bytes, bytes]] | None = None,
    topic: Topic | None = None,
) -> None:
    p = EventProducer(settings.kafka)
    for ev in events:
        p.send(ev, topic)
    for topic, key, value in raw or []:
        p.send_raw(topic, value, key=key)
    p.flush()
    p.close()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"
