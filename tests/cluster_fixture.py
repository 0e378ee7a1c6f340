"""A private cluster stack for the tests: ``trainguard stack up --cluster``'s own code in a temporary
home on free ports (3 KRaft brokers, 2 ClickHouse replicas, ZooKeeper), never the shared stack.

Module-scoped: a module that stops brokers or replicas leaves no damage to the next one.  The
brokers' heaps are small (256 MiB): three of them share the test machine with everything else.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.net import free_port_block, free_ports
from trainguard.infra.config import Settings, load_settings
from trainguard.infra.stack.manager import Stack


def cluster_env(home: Path) -> dict[str, str]:
    """``TRAINGUARD_*`` variables of a private cluster stack in ``home`` (and of a one-node stack
    there on ports nobody listens on, so nothing reaches the shared stack)."""
    kafka, controller, http, tcp, zk = free_ports(5)
    base = free_port_block(3 + 3 + 2 + 2 + 2)  # brokers, controllers, HTTP, native, interserver
    return {
        "TRAINGUARD_HOME": str(home),
        "TRAINGUARD__STACK__CLUSTER": "true",
        "TRAINGUARD__STACK__KAFKA_PORT": str(kafka),
        "TRAINGUARD__STACK__KAFKA_CONTROLLER_PORT": str(controller),
        "TRAINGUARD__STACK__CLICKHOUSE_HTTP_PORT": str(http),
        "TRAINGUARD__STACK__CLICKHOUSE_TCP_PORT": str(tcp),
        "TRAINGUARD__STACK__CLUSTER_KAFKA_PORT": str(base),
        "TRAINGUARD__STACK__CLUSTER_KAFKA_CONTROLLER_PORT": str(base + 3),
        "TRAINGUARD__STACK__CLUSTER_CLICKHOUSE_HTTP_PORT": str(base + 6),
        "TRAINGUARD__STACK__CLUSTER_CLICKHOUSE_TCP_PORT": str(base + 8),
        "TRAINGUARD__STACK__CLUSTER_CLICKHOUSE_INTERSERVER_PORT": str(base + 10),
        "TRAINGUARD__STACK__ZOOKEEPER_PORT": str(zk),
        "TRAINGUARD__STACK__CLUSTER_KAFKA_HEAP_MB": "256",
    }


@pytest.fixture(scope="module")
def cluster_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """Settings of a running private cluster stack (topics created, migrations applied)."""
    env = cluster_env(tmp_path_factory.mktemp("cluster-home"))
    settings = load_settings(environ=env)
    stack = Stack(settings)
    try:
        stack.up()
        yield settings
    finally:
        stack.down()
