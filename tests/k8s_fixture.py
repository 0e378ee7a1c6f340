"""A real private Kubernetes control plane for the tests (no mocked client, no mocked API).

``trainguard stack up --k8s``'s own code (:class:`trainguard.infra.stack.k8s.K8sCluster`) starts etcd,
kube-apiserver, kube-scheduler, kube-controller-manager, kwok and the pod runner in a temporary
stack home on free ports, once per test session, with eight kwok nodes ``n1``..``n8``.  The
binaries come from the test command's build (``TRAINGUARD_SETUP_K8S=1 scripts/setup.sh``, cached
per machine).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.net import free_port_range, free_ports
from tests.waiting import wait_until
from trainguard.actions.executors.base import ExecutorEnv, StepContext
from trainguard.actions.executors.kubernetes import (
    JOB_LABEL,
    KubernetesExecutor,
    KubernetesExecutorConfig,
    job_label,
)
from trainguard.infra.config import load_settings
from trainguard.infra.stack.k8s import K8sCluster
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import JobSpec
from trainguard.schemas.topology import JobTopology

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
        cluster.start()  # no progress lines in the test output
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
            "metadata": {"annotations": {"trainguard.io/evicted-by": None, "trainguard.io/self-check": None}},
            "spec": {
                "unschedulable": False,
                "taints": [{k: v for k, v in t.items() if v is not None} for t in taints],
            },
        }
        core.patch_node(node.metadata.name, body)


TRAIN_POD = Path(__file__).resolve().parent / "fixtures" / "k8s" / "train_pod.py"


def ctx(step: str, decision: str = "", seconds: float = 30.0, category: str = "") -> StepContext:
    return StepContext(
        decision_id=decision or f"dec-{uuid.uuid4().hex[:8]}",
        step=step,
        attempt=1,
        deadline=time.monotonic() + seconds,
        category=category,
    )


def make_spec(job: str, active: list[str], standbys: list[str] | None = None) -> JobSpec:
    topo = JobTopology(job=job, tp=1, pp=1, dp=len(active), ranks_per_machine=1, machines=active)
    return JobSpec(job=job, ts_ms=now_ms(), topology=topo, standbys=standbys or [])


def template(out: Path) -> dict[str, Any]:
    return {
        "metadata": {"labels": {"trainguard.io/local-run": "true"}},
        "spec": {
            "containers": [
                {"name": "main", "image": "local", "command": [sys.executable, str(TRAIN_POD), str(out)]}
            ]
        },
    }


@pytest.fixture
def k8s_job(k8s_cluster: K8sCluster, tmp_path: Path) -> Any:
    out = tmp_path / "beats"
    out.mkdir()
    cfg = KubernetesExecutorConfig(
        kubeconfig=str(k8s_cluster.executor_kubeconfig),
        pod_template=template(out),
        standby_command=[sys.executable, str(TRAIN_POD), str(out), "--standby"],
        diagnostic_commands={"ok": ["true"], "broken": [sys.executable, "-c", "raise SystemExit(3)"]},
        grace_period_s=5,
        poll_s=0.1,
    )
    ex = KubernetesExecutor(cfg, ExecutorEnv(state_dir=tmp_path / "state"))
    name = f"job-{uuid.uuid4().hex[:6]}"
    yield name, ex, out
    clean_up(k8s_cluster, name)
    ex.close()


def clean_up(cluster: K8sCluster, job: str) -> None:
    """Leave the cluster as found: ``job``'s pods gone, every node uncordoned."""
    core = admin(cluster)
    core.delete_collection_namespaced_pod(
        "training", label_selector=f"{JOB_LABEL}={job_label(job)}", grace_period_seconds=0
    )
    wait_until(
        lambda: (
            not core.list_namespaced_pod("training", label_selector=f"{JOB_LABEL}={job_label(job)}").items
        ),
        30,
        f"the pods of {job} to go",
    )
    restore_nodes(cluster)


def beat(out: Path, node: str, role: str = "train") -> dict[str, Any] | None:
    try:
        return json.loads((out / f"{node}.{role}.json").read_text())
    except (OSError, ValueError):
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
