"""``trainguard stack up | down | status | reset``: the embedded Kafka + ClickHouse stack.

With ``--slurm`` the stack also runs a private local Slurm cluster (:mod:`trainguard.infra.stack.slurm`), with
``--k8s`` a private Kubernetes control plane (:mod:`trainguard.infra.stack.k8s`).  With ``stack.cluster``
(``stack up --cluster``) Kafka and ClickHouse are the local cluster of :mod:`trainguard.infra.stack.cluster`
instead: 3 brokers, 2 ClickHouse replicas and ZooKeeper.  ``down`` and ``reset`` cover both topologies.

``up`` is idempotent: servers already running are left alone, then the registry's topics and
the ClickHouse migrations are applied (both idempotent too).  ``down`` stops only the processes
whose pid files this stack home owns.  ``reset`` is ``down`` plus deleting the home's data.
``up`` reports each phase to a :class:`~trainguard.infra.progress.Progress` (stderr unless given one): what
runs now and for how long, Maven's downloads on a first start, the Kubernetes build's minutes.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.infra.bus import create_topics
from trainguard.infra.clickhouse.store import ClickHouseStore, StoreError
from trainguard.infra.config import Settings
from trainguard.infra.progress import Progress
from trainguard.infra.signing import init_keys
from trainguard.infra.stack.clickhouse import ClickHouseServer, ping
from trainguard.infra.stack.cluster import LocalCluster
from trainguard.infra.stack.k8s import K8sCluster
from trainguard.infra.stack.kafka import KafkaServer, broker_reachable
from trainguard.infra.stack.procs import StackError
from trainguard.infra.stack.slurm import Slurm


@dataclass
class UpReport:
    started: list[str] = field(default_factory=list)
    topics_created: list[str] = field(default_factory=list)
    migrations_applied: list[str] = field(default_factory=list)
    #: principal -> key id of the embedded stack's signing keys (created when missing).
    keys: dict[str, str] = field(default_factory=dict)
    #: seconds until every Slurm node was idle (None: Slurm not requested).
    slurm_idle_s: float | None = None
    slurm_nodes: list[str] = field(default_factory=list)
    #: seconds the Kubernetes control plane took (build included; None: not requested).
    k8s_s: float | None = None
    k8s_nodes: list[str] = field(default_factory=list)
    seconds: float = 0.0


class Stack:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.kafka = KafkaServer(settings.stack)
        self.clickhouse = ClickHouseServer(settings.stack)
        self.slurm = Slurm(settings.stack)
        self.k8s = K8sCluster(settings.stack)
        self.cluster = LocalCluster(settings.stack)

    def _require_embedded(self) -> None:
        if not self.settings.stack.embedded:
            raise StackError(
                "stack.embedded is false: this configuration points at external Kafka/ClickHouse, "
                "there is no local stack to start or stop"
            )

    def up(
        self,
        slurm: bool = False,
        slurm_nodes: int | None = None,
        k8s: bool = False,
        k8s_nodes: int | None = None,
        progress: Progress | None = None,
    ) -> UpReport:
        """Start Kafka and ClickHouse (with ``slurm`` the private Slurm, with ``k8s`` Kubernetes).

        ``progress``: the caller's (it closes it); without one, a line on stderr of its own.
        """
        self._require_embedded()
        if progress is not None:
            return self._up(slurm, slurm_nodes, k8s, k8s_nodes, progress)
        with Progress("stack up", summary=False) as bar, bar.ticking():
            return self._up(slurm, slurm_nodes, k8s, k8s_nodes, bar)

    def _up(
        self, slurm: bool, slurm_nodes: int | None, k8s: bool, k8s_nodes: int | None, bar: Progress
    ) -> UpReport:
        t0 = time.monotonic()
        report = UpReport()
        self.settings.stack.home_path.mkdir(parents=True, exist_ok=True)
        if slurm:
            self.slurm = Slurm(self.settings.stack, nodes=slurm_nodes)
        # Check every port before starting anything: no half-started stack on a conflict.
        bar.phase("checking ports")
        cluster = self.settings.stack.cluster
        if cluster:
            self.cluster.check_ports()
        else:
            self.clickhouse.check_ports()
            self.kafka.check_ports()
        if slurm:
            self.slurm.check_ports()
        if k8s:
            self.k8s = K8sCluster(self.settings.stack, nodes=k8s_nodes)
            self.k8s.check_ports()
        timeout = self.settings.stack.start_timeout_s
        if cluster:
            report.started += self.cluster.start(bar, timeout)
        else:
            self._start_single(report, bar, timeout)
        if slurm:
            bar.phase(f"slurm: starting {len(self.slurm.cfg.node_names)} node(s)")
            report.started += self.slurm.start()
            bar.phase("slurm: waiting until every node is idle")
            report.slurm_idle_s = self.slurm.wait_idle(timeout)
            report.slurm_nodes = self.slurm.cfg.node_names
        if k8s:
            t1 = time.monotonic()
            report.started += self.k8s.start(bar)
            report.k8s_s = time.monotonic() - t1
            report.k8s_nodes = self.k8s.cfg.node_names
        bar.phase("kafka: creating topics")
        report.topics_created = create_topics(self.settings.kafka)
        bar.phase("clickhouse: applying migrations")
        store = ClickHouseStore(self.settings.clickhouse)
        try:
            report.migrations_applied = [f"{m.version:04d}_{m.name}" for m in store.migrate()]
        finally:
            store.close()
        bar.phase("signing keys")
        # The embedded stack's processes all share this home: one key set for every principal,
        # so turning `signing.enabled` on needs no other step here (a real cluster gives each
        # role its own key: `trainguard keys init` per machine, public keys in trusted.yaml).
        keys_dir = Path(self.settings.signing.keys_dir or self.settings.stack.home_path / "keys")
        report.keys = init_keys(keys_dir)
        report.seconds = time.monotonic() - t0
        return report

    def _start_single(self, report: UpReport, bar: Progress, timeout: float) -> None:
        # Start both first, then wait: the JVM's start-up overlaps ClickHouse's.
        bar.phase("clickhouse: starting")
        if self.clickhouse.start():
            report.started.append("clickhouse")
        bar.phase("kafka: starting")
        if self.kafka.start(bar):
            report.started.append("kafka")
        bar.phase("clickhouse: waiting until it answers")
        self.clickhouse.wait_healthy(timeout)
        bar.phase("kafka: waiting until the broker answers")
        self.kafka.wait_healthy(timeout)

    def down(self) -> list[str]:
        """Stop every process of this home: both topologies, whichever ``stack.cluster`` says."""
        self._require_embedded()
        stopped = self.k8s.stop()
        stopped += self.slurm.stop()
        if self.kafka.stop():
            stopped.append("kafka")
        if self.clickhouse.stop():
            stopped.append("clickhouse")
        stopped += self.cluster.stop()
        return stopped

    def reset(self) -> list[str]:
        stopped = self.down()
        home = self.settings.stack.home_path
        for sub in ("kafka", "clickhouse", "slurm", "k8s", "cluster"):
            shutil.rmtree(home / sub, ignore_errors=True)
        return stopped

    def status(self) -> dict[str, Any]:
        """Endpoints and health of both servers (embedded or external)."""
        s = self.settings
        kafka_ok = broker_reachable(s.kafka, timeout_s=3.0)
        # Over TLS the client's CA, certificate and verification settings apply: ask the store.
        direct = s.clickhouse.dsn or s.clickhouse.secure
        ch_ok = ClickHouseStore(s.clickhouse).ping() if direct else ping(s.clickhouse.url)
        out: dict[str, Any] = {
            "kafka": {"bootstrap_servers": s.kafka.bootstrap_servers, "healthy": kafka_ok},
            "clickhouse": {"url": s.clickhouse.url, "database": s.clickhouse.database, "healthy": ch_ok},
            "embedded": s.stack.embedded,
            "healthy": kafka_ok and ch_ok,
        }
        if s.stack.embedded:
            out["home"] = str(s.stack.home_path)
            if not s.stack.cluster:
                out["kafka"]["pid"] = self.kafka.proc.pid()
                out["clickhouse"]["pid"] = self.clickhouse.proc.pid()
            # The cluster stack: every process, also when clients use the one-node stack (its
            # processes run, and `down` stops them: status must show them).
            out["cluster"] = self.cluster.status()
            if s.stack.cluster or out["cluster"]["running"]:
                out["healthy"] = out["healthy"] and out["cluster"]["healthy"]
            # Slurm is optional (`stack up --slurm`): it counts towards "healthy" only when it runs.
            out["slurm"] = self.slurm.status()
            if out["slurm"]["running"]:
                out["healthy"] = out["healthy"] and out["slurm"]["healthy"]
            out["k8s"] = self.k8s.status()
            if out["k8s"]["running"]:
                out["healthy"] = out["healthy"] and out["k8s"]["healthy"]
        if ch_ok:
            try:
                store = ClickHouseStore(s.clickhouse)
                out["clickhouse"]["migrations"] = sorted(store.applied_migrations())
                store.close()
            except StoreError as exc:
                out["clickhouse"]["error"] = str(exc)
        return out
