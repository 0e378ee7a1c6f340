"""The local cluster of ``trainguard stack up --cluster``: what tests and benches lose nodes of.

Kafka brokers in KRaft mode (``stack.cluster_kafka_brokers``, 3: each broker also a voter of the
controller quorum, so losing any one keeps a majority), ClickHouse replicas of one shard
(``stack.cluster_clickhouse_replicas``, 2) and the ZooKeeper that coordinates them, all local
processes on ports of their own (``stack.cluster_*``), under ``<home>/cluster``.  It lives beside the
one-node stack of the same home (other ports, other folders); clients use it with
``stack.cluster: true`` (:func:`trainguard.infra.config.load_settings` then points them here).
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trainguard.infra.config import KafkaConfig, StackConfig
from trainguard.infra.progress import Progress
from trainguard.infra.stack.clickhouse import (
    ClickHouseServer,
    cluster_replicas,
    find_binary,
    install_with_apt,
)
from trainguard.infra.stack.kafka import KafkaServer, broker_reachable, cluster_nodes
from trainguard.infra.stack.zookeeper import ZooKeeperServer


class LocalCluster:
    """Start, stop and check every process of the cluster stack."""

    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        self.dir = cfg.home_path / "cluster"
        self.zookeeper = ZooKeeperServer(cfg)
        self.brokers = [KafkaServer(cfg, node) for node in cluster_nodes(cfg)]
        self.replicas = [ClickHouseServer(cfg, node) for node in cluster_replicas(cfg)]

    def check_ports(self) -> None:
        """Every port first: no half-started cluster on a conflict."""
        self.zookeeper.check_ports()
        for b in self.brokers:
            b.check_ports()
        for r in self.replicas:
            r.check_ports()

    def start(self, bar: Progress, timeout_s: float) -> list[str]:
        """Start what is not running and wait until all of it answers; returns what was started."""
        started: list[str] = []
        java = KafkaServer.java()
        bar.phase("zookeeper: starting")
        if self.zookeeper.start(java):
            started.append("zookeeper")
        # The brokers' JVMs start while ZooKeeper comes up; the replicas need it up first (a
        # replica that cannot reach ZooKeeper starts with its replicated tables read-only).
        for b in self.brokers:
            if b.start(bar):
                started.append(b.node.name)
        bar.phase("zookeeper: waiting until it answers")
        self.zookeeper.wait_healthy(timeout_s)
        if any(r.proc.pid() is None for r in self.replicas):
            find_binary() or install_with_apt()
        for r in self.replicas:
            bar.phase(f"{r.node.name}: starting")
            if r.start():
                started.append(r.node.name)
        for r in self.replicas:
            bar.phase(f"{r.node.name}: waiting until it answers")
            r.wait_healthy(timeout_s)
        for b in self.brokers:
            bar.phase(f"{b.node.name}: waiting until the broker answers")
            b.wait_healthy(timeout_s)
        return started

    def stop(self) -> list[str]:
        """Stop this home's cluster processes: the replicas and the brokers together, then
        ZooKeeper (which the replicas need while they stop).  Together, not one by one: a broker
        stopping after the other voters of its KRaft quorum are gone has no controller to hand
        its partitions to, and one after another ``down`` took 77 s (10.5 s together;
        ``tests/infra/test_cluster_stack.py``, 2 cores)."""
        try:
            with ThreadPoolExecutor(max_workers=len(self.replicas) + len(self.brokers) or 1) as pool:
                replicas = [(r.node.name, pool.submit(r.stop)) for r in self.replicas]
                brokers = [(b.node.name, pool.submit(b.stop)) for b in self.brokers]
                stopped = [name for name, done in replicas + brokers if done.result()]
        finally:  # ZooKeeper is stopped even if stopping another process raised
            zookeeper = self.zookeeper.stop()
        return [*stopped, "zookeeper"] if zookeeper else stopped

    def running(self) -> bool:
        procs = [self.zookeeper.proc, *(b.proc for b in self.brokers), *(r.proc for r in self.replicas)]
        return any(p.pid() is not None for p in procs)

    def wipe(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def status(self) -> dict[str, Any]:
        """Each process's pid and health, and the cluster's as a whole."""
        brokers = [
            {
                "name": b.node.name,
                "bootstrap": b.bootstrap,
                "pid": b.proc.pid(),
                "healthy": b.proc.pid() is not None
                and broker_reachable(KafkaConfig(bootstrap_servers=b.bootstrap), 2.0),
            }
            for b in self.brokers
        ]
        replicas = [
            {"name": r.node.name, "url": r.url, "pid": r.proc.pid(), "healthy": r.healthy()}
            for r in self.replicas
        ]
        zk: dict[str, Any] = {
            "port": self.cfg.zookeeper_port,
            "pid": self.zookeeper.proc.pid(),
            "healthy": self.zookeeper.healthy(),
        }
        parts: list[dict[str, Any]] = [*brokers, *replicas, zk]
        return {
            "running": self.running(),
            "healthy": all(p["healthy"] for p in parts),
            "kafka": brokers,
            "clickhouse": replicas,
            "zookeeper": zk,
        }
