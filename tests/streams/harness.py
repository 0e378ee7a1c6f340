"""Test harness for stream workers: a real `trainguard worker` process, a producer and a watcher.

Nothing is mocked: the worker is the real CLI in a subprocess, against the real broker and
ClickHouse of the local stack.  Each test uses its own job/node names, so tests share a worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.waiting import wait_until
from trainguard.infra.bus import EventProducer, signer_for
from trainguard.infra.config import Settings
from trainguard.schemas.base import Event
from trainguard.schemas.codec import DecodeError, decode
from trainguard.schemas.control import Decision
from trainguard.schemas.topics import Topic


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
        proc, deadline = self.proc, time.monotonic() + timeout_s

        def serving() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited with {proc.returncode}:\n{self.log_tail()}")
            return self.healthz() is not None

        try:
            wait_until(
                serving,
                timeout_s,
                lambda: f"worker {self.app_id} to serve /healthz on port {self.web_port}:\n{self.log_tail()}",
                interval_s=0.3,
            )
            if self.settings is not None:
                self._wait_until_consuming(self.settings, deadline - time.monotonic())
        except BaseException:
            # A worker that never became ready must not outlive the test: left running, it reads
            # the shared topics and doubles the decisions every later test counts.
            self.kill()
            raise
        return self

    def _wait_until_consuming(self, settings: Settings, timeout_s: float) -> None:
        """Probe with an Xid line until its decision comes back: the group has joined and consumes."""
        from trainguard.schemas.base import now_ms
        from trainguard.schemas.topics import DECISIONS
        from trainguard.schemas.workload import LogLine

        watcher = Watcher(settings, DECISIONS)
        line = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus."

        def probe_answered() -> bool:  # a fresh probe each time: one sent before the group joined is lost
            node = unique("probe")
            send(settings, LogLine(node=node, ts_ms=now_ms(), source="kernel", line=line, job="probe"))

            def answered(e: Event) -> bool:
                return isinstance(e, Decision) and e.job == "probe" and node in e.targets.machines

            try:
                watcher.wait_for(answered, 3.0)
                return True
            except AssertionError:
                return False

        try:
            wait_until(
                probe_answered,
                max(timeout_s, 0.0),
                lambda: f"worker {self.app_id} to consume (answer a probe):\n{self.log_tail()}",
                interval_s=0,
            )
        finally:
            watcher.close()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def healthz(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/healthz", timeout=1) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/metrics", timeout=2) as r:
            return r.read().decode()

    def followed(self, topic: Topic) -> dict[int, int]:
        """Partition -> offset of the next record this worker's own reader of ``topic`` (a topic
        every worker reads whole: jobs, control) will read (``trainguard_follow_offset``)."""
        out: dict[int, int] = {}
        for labels, value in re.findall(r"^trainguard_follow_offset\{(.*)\} (\S+)$", self.metrics(), re.M):
            tags = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            if tags.get("topic") == topic.name:
                out[int(tags["partition"])] = int(float(value))
        return out

    def wait_followed(self, settings: Settings, topic: Topic, timeout_s: float = 30.0) -> None:
        """Until this worker has read and handled ``topic`` up to its end as of now: everything
        produced to it before the call (a job spec, a control command) has reached the worker."""
        from kafka import KafkaConsumer, TopicPartition

        consumer = KafkaConsumer(**settings.kafka.client_kwargs(), group_id=None, enable_auto_commit=False)
        try:
            parts = [TopicPartition(topic.name, p) for p in range(topic.partitions)]
            begin, end = consumer.beginning_offsets(parts), consumer.end_offsets(parts)
        finally:
            consumer.close()
        want = {tp.partition: end[tp] for tp in parts if end[tp] > begin[tp]}  # empty ones: nothing to read
        wait_until(
            lambda: all(self.followed(topic).get(p, 0) >= n for p, n in want.items()),
            timeout_s,
            lambda: f"worker {self.app_id} to read {topic.name} up to {want} (at {self.followed(topic)})",
        )

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
        def first() -> Event | None:
            return next((ev for ev in self.seen if pred(ev)), None)

        def found() -> Event | None:
            if (ev := first()) is not None:
                return ev
            self.poll()  # waits up to 200 ms for records: no sleep between rounds
            return first()

        return wait_until(
            found,
            timeout_s,
            lambda: f"a matching event; saw {len(self.seen)}: {self.seen[-5:]}",
            interval_s=0,
        )

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
    p = EventProducer(settings.kafka, signer=signer_for(settings, "operator"))  # as an operator would
    for ev in events:
        p.send(ev, topic)
    for name, key, value in raw or []:
        p.send_raw(name, value, key=key, sign=True)  # garbage past verification: the decoder's case
    p.flush()
    p.close()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"
