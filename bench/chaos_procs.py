"""The chaos suite's private stack and the real processes it runs (``bench/chaos.py``).

:class:`ChaosStack` is a stack home of its own (a temporary ``TRAINGUARD_HOME``, free ports,
signing on) started and stopped with the real CLI (``trainguard stack up|down``); every process the
suite starts gets an environment with only that stack's variables, so nothing it runs -- or kills --
can reach the shared stack.  :class:`Worker`, :class:`ActionsProcess` and :class:`ExporterProcess`
are the real CLI commands as subprocesses (each in a session of its own, so SIGKILL takes the whole
process); :class:`TopicReader` reads topics without a consumer group and keeps what it saw.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar

import yaml

from trainguard.actions.progress import ProgressStore
from trainguard.infra.bus import EventProducer, signer_for
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.config import Settings, load_settings
from trainguard.infra.stack.clickhouse import ClickHouseServer
from trainguard.infra.stack.kafka import KafkaServer
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.codec import decode
from trainguard.schemas.control import ActionEvent, ActionPhase, Decision
from trainguard.schemas.topics import DECISIONS, TOPICS, Topic
from trainguard.schemas.workload import LogLine

EXE = str(Path(sys.executable).with_name("trainguard"))
XID_79 = "[ 8123.456789] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."
#: the job of the readiness probes (an Xid on a fresh node of it must come back as a decision).
PROBE_JOB = "chaos-probe"
#: worker settings shortened for a bench (sink flushes and retries within a second).
WORKER_ENV = {
    "TRAINGUARD__WORKER__CHECK_INTERVAL_S": "1",
    "TRAINGUARD__WORKER__SINK__MAX_WAIT_S": "0.3",
    "TRAINGUARD__WORKER__SINK__RETRY_BACKOFF_MAX_S": "1",
}
T = TypeVar("T")


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports nobody listens on now (bound at once, so none repeats)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def wait_until(cond: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.2) -> T:
    """Poll ``cond`` until it is truthy (returned) or raise ``TimeoutError`` naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class ChaosStack:
    """A private embedded stack: its own home, ports and keys; see the module docstring."""

    def __init__(self, home: Path, ports: dict[str, int] | None = None) -> None:
        self.home = home.resolve()
        self.home.mkdir(parents=True, exist_ok=True)
        self.logs = self.home / "chaos-logs"
        self.logs.mkdir(exist_ok=True)
        saved = self.home / "chaos-ports.json"
        if ports is None and saved.exists():  # a kept home (--home) keeps its ports
            ports = json.loads(saved.read_text())
        if ports is None:
            names = ("KAFKA_PORT", "KAFKA_CONTROLLER_PORT", "CLICKHOUSE_HTTP_PORT", "CLICKHOUSE_TCP_PORT")
            ports = dict(zip(names, free_ports(4), strict=True))
        saved.write_text(json.dumps(ports))
        # Nothing of the caller's TrainGuard settings leaks in (a bootstrap server or a config file
        # would point the clients at the shared stack).
        base = {k: v for k, v in os.environ.items() if not k.upper().startswith("TRAINGUARD")}
        self.env = {
            **base,
            "TRAINGUARD_HOME": str(self.home),
            "TRAINGUARD__SIGNING__ENABLED": "true",
            **{f"TRAINGUARD__STACK__{k}": str(v) for k, v in ports.items()},
        }
        self.ports = ports
        self.settings: Settings = load_settings(environ=self.env)
        self._check_private()
        self.procs: list[Proc] = []

    def _check_private(self) -> None:
        s = self.settings
        kafka_port = int(s.kafka.bootstrap_servers.rsplit(":", 1)[1])
        if kafka_port != self.ports["KAFKA_PORT"] or s.clickhouse.port != self.ports["CLICKHOUSE_HTTP_PORT"]:
            raise RuntimeError(f"clients would not reach the private stack: {s.kafka}, {s.clickhouse}")
        if s.stack.home_path != self.home or not s.signing.enabled:
            raise RuntimeError(f"private stack settings are off: {s.stack}, {s.signing}")

    # -- the stack --------------------------------------------------------------------------------
    def cli(self, *args: str, env: dict[str, str] | None = None, timeout_s: float = 240) -> str:
        """Run ``trainguard ARGS`` against this stack; its output (RuntimeError if it failed)."""
        res = subprocess.run(
            [EXE, *args], env=env or self.env, capture_output=True, text=True, timeout=timeout_s
        )
        if res.returncode != 0:
            raise RuntimeError(f"trainguard {' '.join(args)} exited {res.returncode}: {res.stderr[-2000:]}")
        return res.stdout

    def up(self) -> None:
        self.cli("stack", "up")

    def down(self) -> None:
        self.stop_all()
        self.cli("stack", "down", timeout_s=150)

    def kafka(self) -> KafkaServer:
        return KafkaServer(self.settings.stack)

    def clickhouse(self) -> ClickHouseServer:
        return ClickHouseServer(self.settings.stack)

    def store(self) -> ClickHouseStore:
        return ClickHouseStore(self.settings.clickhouse)

    def producer(self, principal: str | None = "operator") -> EventProducer:
        """A producer signing as ``principal`` (None: unsigned)."""
        signer = signer_for(self.settings, principal) if principal else None
        return EventProducer(self.settings.kafka, signer=signer)

    def raw_producer(self) -> Any:
        from kafka import KafkaProducer

        return KafkaProducer(**self.settings.kafka.client_kwargs(), linger_ms=5, acks="all")

    def send(self, *events: Event, principal: str = "operator", topic: Topic | None = None) -> list[Any]:
        """Publish ``events`` signed as ``principal``; their record metadata (acknowledged)."""
        p = self.producer(principal)
        try:
            futures = [p.send(ev, topic) for ev in events]
            p.flush()
            return [f.get(timeout=30) for f in futures]
        finally:
            p.close()

    # -- processes --------------------------------------------------------------------------------
    def track(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            with contextlib.suppress(Exception):
                p.stop()
        self.procs.clear()

    def worker_group(self, prefix: str) -> str:
        """A new stream-worker group (app id) whose agents and sink start at the current end of
        every topic: a scenario's workers see its own records, not the history of the run."""
        app_id = unique(prefix)
        commit_at_end(self, [app_id, f"{app_id}-sink"])
        return app_id

    def worker(self, name: str, app_id: str, extra_env: dict[str, str] | None = None) -> Worker:
        (port,) = free_ports(1)
        env = {**self.env, **WORKER_ENV, **(extra_env or {})}
        w = Worker(name, app_id, port, env, self.logs / f"{name}.log")
        self.track(w)
        return w

    def actions(self, name: str, cfg: dict[str, Any]) -> ActionsProcess:
        a = ActionsProcess(name, self, cfg)
        self.track(a)
        return a

    def exporter(self, node: str, job: str, extra: list[str], cfg: dict[str, Any]) -> ExporterProcess:
        e = ExporterProcess(self, node, job, extra, cfg)
        self.track(e)
        return e


class Proc:
    """One CLI subprocess in a session of its own; only this object ever signals it."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.argv, self.env, self.log = name, argv, env, log
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Self:
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def _signal(self, sig: int) -> None:
        if self.alive():
            assert self.popen is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)  # its own session: the process and its children

    def kill(self) -> None:
        """SIGKILL: no clean shutdown, no final commit."""
        self._signal(signal.SIGKILL)
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(10)

    def stop(self, timeout_s: float = 30) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; the exit code."""
        if self.popen is None:
            return None
        self._signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        return self.popen.returncode

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


class Worker(Proc):
    """``trainguard worker`` in the worker group ``app_id``."""

    def __init__(self, name: str, app_id: str, web_port: int, env: dict[str, str], log: Path) -> None:
        argv = [EXE, "worker", "--app-id", app_id, "--web-port", str(web_port), "--loglevel", "warning"]
        super().__init__(name, argv, env, log)
        self.app_id, self.web_port = app_id, web_port

    def healthz(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/healthz", timeout=2) as r:
                return dict(json.loads(r.read()))
        except urllib.error.HTTPError as exc:  # 503: an agent stalled; the body says which
            with contextlib.suppress(ValueError):
                return dict(json.loads(exc.read()))
            return None
        except (OSError, ValueError):
            return None

    def healthy(self) -> bool:
        h = self.healthz()
        return self.alive() and h is not None and bool(h.get("ok"))

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/metrics", timeout=3) as r:
            return str(r.read().decode())

    def metric(self, name: str) -> float:
        """The sum of every sample of metric ``name`` (0 when absent or unreachable)."""
        try:
            text = self.metrics()
        except OSError:
            return 0.0
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    def followed(self, topic: Topic) -> dict[int, int]:
        """Partition -> next offset this worker's own reader of ``topic`` will read."""
        out: dict[int, int] = {}
        try:
            text = self.metrics()
        except OSError:
            return out
        for labels, value in re.findall(r"^trainguard_follow_offset\{(.*)\} (\S+)$", text, re.M):
            tags = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            if tags.get("topic") == topic.name:
                out[int(tags["partition"])] = int(float(value))
        return out

    def wait_ready(self, stack: ChaosStack, timeout_s: float = 180) -> float:
        """Until /healthz answers and an Xid probe comes back as a decision; seconds it took."""
        t0 = time.monotonic()

        def serving() -> bool:
            if not self.alive():
                raise RuntimeError(f"worker {self.name} exited:\n{self.log_tail()}")
            return self.healthz() is not None

        wait_until(serving, timeout_s, f"worker {self.name} to serve /healthz", 0.5)
        wait_decision_probe(stack, timeout_s - (time.monotonic() - t0), f"worker {self.name}")
        return time.monotonic() - t0


def wait_decision_probe(stack: ChaosStack, timeout_s: float, who: str = "the workers") -> float:
    """Send Xid probes on fresh nodes until one comes back as a decision; the latency of that one."""
    reader = TopicReader(stack, [DECISIONS])
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            node = unique("probe")
            sent = now_ms()
            stack.send(LogLine(node=node, ts_ms=sent, source="kernel", line=XID_79, job=PROBE_JOB))
            try:
                seen = reader.wait_for(decision_for(node), 5)
                return (seen.at_ms - sent) / 1000
            except TimeoutError:
                continue
        raise TimeoutError(f"{who} never answered an Xid probe within {timeout_s:.0f} s")
    finally:
        reader.close()


def decision_for(node: str) -> Callable[[Seen], bool]:
    """Matches a decision record targeting ``node``."""
    return lambda s: isinstance(s.event, Decision) and node in s.event.targets.machines


def action_event(decision_id: str, step: str, *phases: ActionPhase) -> Callable[[Seen], bool]:
    """Matches an action event of ``decision_id``'s ``step`` in one of ``phases``."""
    return lambda s: (
        isinstance(s.event, ActionEvent)
        and s.event.decision_id == decision_id
        and s.event.step == step
        and s.event.phase in phases
    )


class ActionsProcess(Proc):
    """``trainguard actions`` with a config file of its own (``actions`` section) and dry_run."""

    def __init__(self, name: str, stack: ChaosStack, cfg: dict[str, Any]) -> None:
        self.dir = stack.home / "actions" / unique(name)  # a kept home (--home) holds earlier runs'
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cfg = {
            "group_id": f"chaos-{self.dir.name}",
            "state_dir": str(self.dir),
            "poll_interval_s": 0.2,
            **cfg,
        }
        self.config_file = self.dir / "trainguard.yaml"
        self.config_file.write_text(yaml.safe_dump({"actions": self.cfg}))
        env = {**stack.env, "TRAINGUARD_CONFIG": str(self.config_file)}
        super().__init__(name, [EXE, "actions"], env, stack.logs / f"actions-{name}.log")
        self.stack = stack

    def cli(self, *args: str) -> str:
        return self.stack.cli("actions", *args, env=self.env)

    def store(self) -> ProgressStore:
        return ProgressStore(self.dir / "progress.sqlite")

    def executor_calls(self) -> list[dict[str, Any]]:
        path = self.dir / "executor" / "dry_run.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class ExporterProcess(Proc):
    """``trainguard exporter`` for one simulated node: a kernel log file of its own, state in the
    stack home, the sources in ``extra`` (``--disable``/``--interval`` flags)."""

    def __init__(self, stack: ChaosStack, node: str, job: str, extra: list[str], cfg: dict[str, Any]) -> None:
        self.dir = stack.home / "exporters" / node
        self.dir.mkdir(parents=True, exist_ok=True)
        self.kernel_log = self.dir / "kern.log"
        self.kernel_log.touch()
        cfg_file = self.dir / "exporter.yaml"
        cfg_file.write_text(yaml.safe_dump(cfg))
        argv = [
            EXE,
            "exporter",
            "--node",
            node,
            "--job",
            job,
            "--exporter-config",
            str(cfg_file),
            "--kernel-log",
            str(self.kernel_log),
            "--state-dir",
            str(self.dir / "state"),
            "--socket",
            str(self.dir / "r.sock"),
            *extra,
        ]
        super().__init__(f"exporter-{node}", argv, stack.env, stack.logs / f"exporter-{node}.log")
        self.node = node


@dataclass
class Seen:
    """One record a :class:`TopicReader` read: where, what, and when it arrived here."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    event: Event | None
    at_ms: int


class TopicReader:
    """Reads ``topics`` without a group, from their current end (or from ``start`` offsets)."""

    def __init__(
        self, stack: ChaosStack, topics: Iterable[Topic], start: dict[tuple[str, int], int] | None = None
    ) -> None:
        from kafka import KafkaConsumer, TopicPartition

        self.consumer = KafkaConsumer(
            **stack.settings.kafka.client_kwargs(), group_id=None, enable_auto_commit=False
        )
        parts = [TopicPartition(t.name, p) for t in topics for p in range(t.partitions)]
        self.consumer.assign(parts)
        if start is None:
            self.consumer.seek_to_end(*parts)
            for tp in parts:  # resolve the end now, before the caller produces anything
                self.consumer.position(tp)
        else:
            for tp in parts:
                self.consumer.seek(tp, start.get((tp.topic, tp.partition), 0))
        self.seen: list[Seen] = []

    def poll(self, timeout_ms: int = 200) -> int:
        n = 0
        for recs in self.consumer.poll(timeout_ms=timeout_ms, max_records=5000).values():
            at = now_ms()
            for r in recs:
                try:
                    ev: Event | None = decode(r.value)
                except Exception:  # garbage is the dead-letter counts' business
                    ev = None
                self.seen.append(
                    Seen(r.topic, r.partition, r.offset, r.key, r.value, list(r.headers or []), ev, at)
                )
                n += 1
        return n

    def wait_for(self, pred: Callable[[Seen], bool], timeout_s: float) -> Seen:
        checked = 0

        def found() -> Seen | None:
            nonlocal checked
            self.poll()
            for s in self.seen[checked:]:
                if pred(s):
                    return s
            checked = len(self.seen)
            return None

        return wait_until(found, timeout_s, "a matching record", interval_s=0)

    def drain(self, settle_s: float = 0.0, max_extra_s: float = 30.0) -> None:
        """Read what is there now (and for ``settle_s`` more seconds), then until a poll comes back
        empty, but for at most ``max_extra_s`` past ``settle_s``: on a topic that never goes quiet
        (heartbeats of every exporter left running on a shared chaos stack) "until empty" alone
        never ended."""
        deadline = time.monotonic() + settle_s
        while True:
            got = self.poll()
            now = time.monotonic()
            if now >= deadline and (not got or now >= deadline + max_extra_s):
                return

    def events(self, cls: type[T], pred: Callable[[Any], bool] = lambda _e: True) -> list[T]:
        return [s.event for s in self.seen if isinstance(s.event, cls) and pred(s.event)]

    def close(self) -> None:
        self.consumer.close()


def end_offsets(stack: ChaosStack, topics: Iterable[Topic]) -> dict[tuple[str, int], int]:
    """(topic, partition) -> the offset the next record will get."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(**stack.settings.kafka.client_kwargs(), group_id=None, enable_auto_commit=False)
    parts = [TopicPartition(t.name, p) for t in topics for p in range(t.partitions)]
    try:
        # Right after a private stack comes up, a partition may not have a leader yet and
        # kafka-python's end_offsets then raises KeyError for it (seen in CI): ask again.
        deadline = time.monotonic() + 30
        while True:
            try:
                return {(tp.topic, tp.partition): int(o) for tp, o in c.end_offsets(parts).items()}
            except KeyError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        c.close()


def commit_at_end(stack: ChaosStack, groups: Iterable[str]) -> None:
    """Commit the end of every registry topic for ``groups`` (new ones: they then start there)."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.structs import OffsetAndMetadata

    ends = end_offsets(stack, TOPICS)
    for group in groups:
        c = KafkaConsumer(**stack.settings.kafka.client_kwargs(), group_id=group, enable_auto_commit=False)
        try:
            parts = [TopicPartition(t, p) for t, p in ends]
            c.assign(parts)
            c.commit({tp: OffsetAndMetadata(ends[(tp.topic, tp.partition)], "", -1) for tp in parts})
        finally:
            c.close()


def group_members(stack: ChaosStack, group: str) -> tuple[str, int]:
    """(state, members) of a consumer group; ("?", 0) when the broker cannot say."""
    from kafka import KafkaAdminClient

    try:
        admin = KafkaAdminClient(**stack.settings.kafka.client_kwargs())
    except Exception:
        return "?", 0
    try:
        info = admin.describe_groups([group]).get(group) or {}
        return str(info.get("group_state") or info.get("state") or "?"), len(info.get("members") or [])
    except Exception:
        return "?", 0
    finally:
        admin.close()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]
