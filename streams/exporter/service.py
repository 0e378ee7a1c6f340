"""The whole exporter process: sources + spool/delivery + command listener + stack capture +
Flight Recorder dumps.

``ExporterService(cfg, kafka).start()`` is what ``trainguard exporter`` runs; tests and benches
run it in-process.  The spool lives in ``<state_dir>/spool``.  Its Prometheus metrics
(:mod:`trainguard.streams.exporter.metrics`) are served on ``metrics.host:metrics.port`` while it runs.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from trainguard.detectors.rule_table import default_rule_table, load_rule_table
from trainguard.infra.config import KafkaConfig
from trainguard.infra.metrics_server import MetricsServer, serve_metrics
from trainguard.infra.proctable import ProcTable
from trainguard.infra.signing import Verifier
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import AGENT_KINDS, Command, CommandKind
from trainguard.schemas.telemetry import SourceHealth
from trainguard.streams.exporter.commands import (
    CommandListener,
    capture_args,
    capture_id_of,
    first_round_of,
    interval_args,
)
from trainguard.streams.exporter.config import ExporterConfig
from trainguard.streams.exporter.delivery import Delivery, SpoolPriority
from trainguard.streams.exporter.flight_recorder import FlightRecorderCollector
from trainguard.streams.exporter.metrics import ExporterMetrics
from trainguard.streams.exporter.ranks import RankRegistry
from trainguard.streams.exporter.runner import Exporter
from trainguard.streams.exporter.sources.process import TrackedProcess, discover
from trainguard.streams.exporter.spool import Spool
from trainguard.streams.exporter.stack_capture import StackCapturer

log = logging.getLogger(__name__)


class ExporterService:
    def __init__(
        self, cfg: ExporterConfig, kafka: KafkaConfig, *, nvml: Any = None, verifier: Verifier | None = None
    ) -> None:
        self.cfg = cfg
        state = Path(cfg.state_dir)
        d = cfg.delivery
        self.spool = Spool(
            state / "spool", d.spool_max_bytes, d.spool_segment_bytes, d.spool_fsync_interval_s
        )
        self.metrics = ExporterMetrics()
        self._metrics_server: MetricsServer | None = None
        rules = load_rule_table(cfg.kernel_log.rules) if cfg.kernel_log.rules else default_rule_table()
        self.delivery = Delivery(kafka, self.spool, cfg.delivery, self.metrics, SpoolPriority(rules))
        #: the ranks launchers registered here: the process source and both captures follow them.
        self.ranks = RankRegistry(cfg.process.max_registered, cfg.process.registered_linger_s)
        self.stacks = StackCapturer(cfg.stacks, cfg.node_name, cfg.job, self._discover, self.delivery.publish)
        self.fr = (
            FlightRecorderCollector(
                dataclasses.replace(cfg.flight_recorder, dir=str(cfg.flight_recorder_dir)),
                cfg.node_name,
                cfg.job,
                self._discover,
                self.delivery.publish,
                alive=ProcTable(cfg.sys_path("/proc")).alive,
            )
            if cfg.flight_recorder.enabled
            else None
        )
        self.commands = (
            CommandListener(kafka, cfg.node_name, cfg.job, cfg.commands, self.handle, verifier=verifier)
            if cfg.commands.enabled
            else None
        )
        hooks = [self.delivery.health, self._capture_health]
        if self.fr is not None:
            hooks.append(self.fr.health)
        if self.commands is not None:
            hooks.append(self.commands.health)
        self.exporter = Exporter(
            cfg, self.delivery.publish, nvml=nvml, extra_health=hooks, metrics=self.metrics, ranks=self.ranks
        )

    def _discover(self) -> list[TrackedProcess]:
        """The job's training process trees on this node now (stack and Flight Recorder captures)."""
        cfg = self.cfg
        return discover(cfg.process, cfg.sys_path("/proc"), cfg.sys_path("/sys/fs/cgroup"), self.ranks)

    def _capture_health(self) -> SourceHealth:
        return SourceHealth(name="stacks", ok=True, last_success_ms=now_ms(), error_count=self.stacks.errors)

    def handle(self, cmd: Command) -> None:
        """Act on one command for this node (ValueError: malformed, reported by the listener)."""
        if cmd.kind is CommandKind.CAPTURE_STACKS:
            capture_id = capture_id_of(cmd.command_id, cmd.args)
            rounds, interval = capture_args(cmd.args, self.cfg.stacks.max_rounds)
            first = first_round_of(cmd.args, self.cfg.stacks.max_rounds)
            log.info("capture %s: %d round(s) from %d every %.1f s", capture_id, rounds, first, interval)
            # The Flight Recorder answers once per capture (its first round), and starts first: a
            # dump takes milliseconds, py-spy rounds take longer, and both run on their own threads.
            if self.fr is not None and cmd.args.get("flight_recorder") is True and first == 0:
                self.fr.request(capture_id)
            self.stacks.request(capture_id, rounds, interval, first)
        elif cmd.kind is CommandKind.SET_INTERVAL:
            source, seconds = interval_args(cmd.args)
            self.exporter.set_interval(source, seconds)
        elif cmd.kind in AGENT_KINDS:
            log.debug("command %s (%s) is for the node agent", cmd.command_id, cmd.kind.value)
        else:
            raise ValueError(f"command kind {cmd.kind.value!r} is not for exporters")

    @property
    def metrics_port(self) -> int | None:
        """The port ``/metrics`` is served on (None: not served)."""
        return self._metrics_server.port if self._metrics_server is not None else None

    def start(self) -> None:
        m = self.cfg.metrics
        self._metrics_server = serve_metrics(
            self.metrics.registry, m.host, m.port, f"exporter {self.cfg.node_name}"
        )
        self.delivery.start()
        if self.fr is not None:
            self.fr.start()
        if self.commands is not None:
            self.commands.start()
        self.exporter.start()

    def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Stop sampling, then deliver what is spooled (the rest stays on disk for next time)."""
        self.exporter.stop()
        self.stacks.stop()
        if self.fr is not None:
            self.fr.stop()
        if self.commands is not None:
            self.commands.stop()
        self.delivery.stop(drain_timeout_s)
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None

    def run_forever(self) -> None:
        """Until SIGTERM/SIGINT (main thread only)."""
        done = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: done.set())
        self.start()
        log.info("exporter %s running (sources: %s)", self.cfg.node_name, ", ".join(self.exporter.sources))
        done.wait()
        self.stop()
