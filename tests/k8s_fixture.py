"""A real private Kubernetes control plane for the tests (no mocked client, no mocked API).

``trainguard stack up --k8s``'s own code (:class:`infra.stack.k8s.K8sCluster`) starts etcd,
kube-apiserver, kube-scheduler, kube-controller-manager, kwok and the pod runner in a temporary
stack home on free ports, once per test session, with eight kwok nodes ``n1``..``n8``.  The
binaries come from ``scripts/setup.sh``'s build (cached per machine).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from infra.config import load_settings
from infra.stack.k8s import K8sCluster
from tests.net import free_port_range, free_ports

NODES = 8
#: the eviction's taint, and the one the node controller adds to a cordoned node.
_OURS = ("trainguard.io/evicted", "node.kubernetes.io/unschedulable")


@pytest.fixture(scope="session")
def k8s_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[K8sCluster]:
    home = tmp_path_factory.mktemp("k8s-home")
    api, kafka, controller, http, tcp = free_ports(5)
    etcd = free_port_range(2)  # etcd's peer port is the client port + 1
    env = {
        "TRAINGUARD_HOME": str(home),
        # Ports nobody listens on: nothing here may reach the running embedded stack.
        "TRAINGUARD__STACK__KAFKA_PORT": str(kafka),
        "TRAINGUARD__STACK__KAFKA_CONTROLLER_PORT": str(controller),
        "TRAINGUARD__STACK__CLICKHOUSE_HTTP_PORT": str(http),
        "TRAINGUARD__STACK__CLICKHOUSE_TCP_PORT": str(tcp),
        "TRAINGUARD__STACK__K8S_ETCD_PORT": str(etcd),
        "TRAINGUARD__STACK__K8S_APISERVER_PORT": str(api),
    }
    cluster = K8sCluster(load_settings(environ=env).stack, nodes=NODES)
    try:
        cluster.start(progress=lambda line: None)
        yield cluster
    finally:
        cluster.stop()


def admin(cluster: K8sCluster) -> Any:
    from kubernetes import client, config

    return client.CoreV1Api(config.new_client_from_config(config_file=str(cluster.admin_kubeconfig)))


def restore_nodes(cluster: K8sCluster) -> None:
    """Uncordon every node and drop TrainGuard's taint and annotation (a test's evictions)."""
    core = admin(cluster)
    for node in core.list_node().items:
        taints = [t.to_dict() for t in (node.spec.taints or []) if t.key not in _OURS]
        body = {
            "metadata": {"annotations": {"trainguard.io/evicted-by": None}},
            "spec": {
                "unschedulable": False,
                "taints": [{k: v for k, v in t.items() if v is not None} for t in taints],
            },
        }
        core.patch_node(node.metadata.name, body)
