"""What ``stack up --k8s`` does once the API server answers: the cluster an admin would set up.

* the base's namespaces, priority classes and RBAC (``infra/deploy/k8s/base``: the same objects
  a deployment applies) and the local executor user's bindings (``infra/deploy/k8s/local``);
* one Node object per stack node (``n1..nN``), annotated for kwok, labelled with its network
  position, with GPU capacity; kwok makes them Ready;
* waits until every node is Ready and the jobs' namespace has its default ServiceAccount (pods
  cannot be created before it exists).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard.infra.k8s.apply import apply_documents, load_documents
from trainguard.infra.stack.procs import StackError

if TYPE_CHECKING:
    from trainguard.infra.stack.k8s import K8sCluster

DEPLOY_DIR = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
#: base manifests the local stack applies (the services themselves run as local processes).
_CLUSTER_FILES = ("namespaces.yaml", "priorityclasses.yaml", "rbac.yaml")
JOBS_NAMESPACE = "training"


def admin_client(cluster: K8sCluster) -> Any:
    from kubernetes import config

    return config.new_client_from_config(config_file=str(cluster.admin_kubeconfig))


def node_body(cluster: K8sCluster, name: str) -> dict[str, Any]:
    from trainguard.infra.stack.k8s import KWOK_ANNOTATION

    c = cluster.cfg
    capacity = {
        "cpu": str(c.cpus_per_node),
        "memory": "256Gi",
        "pods": "110",
        "nvidia.com/gpu": str(c.gpus_per_node),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1]},
            "labels": c.labels(name),
        },
        "spec": {},
        "status": {"allocatable": capacity, "capacity": capacity},
    }


def bootstrap(cluster: K8sCluster, timeout_s: float) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    api = admin_client(cluster)
    try:
        docs = [d for f in _CLUSTER_FILES for d in load_documents(DEPLOY_DIR / "base" / f)]
        docs += load_documents(DEPLOY_DIR / "local" / "executor-user.yaml")
        deadline = time.monotonic() + timeout_s
        while True:  # RBAC's bootstrap roles appear a moment after /readyz
            try:
                apply_documents(api, docs)
                break
            except ApiException as exc:
                if time.monotonic() > deadline:
                    raise StackError(
                        f"applying the cluster's base objects failed: {exc.status} {exc.reason}"
                    ) from exc
                time.sleep(0.5)
        core = client.CoreV1Api(api)
        existing = {n.metadata.name for n in core.list_node().items}
        for name in cluster.cfg.node_names:
            if name not in existing:
                core.create_node(node_body(cluster, name))
        while time.monotonic() < deadline:
            states = {n["name"]: n for n in node_states(cluster, api)}
            # Ready is not enough: the node lifecycle controller drops the not-ready taint it put
            # on each new node a few seconds later (longer on a busy host), and until then the
            # executor's restart refuses the node.
            ready = all(
                states.get(n, {}).get("ready") and not _heartbeat_tainted(states[n]["taints"])
                for n in cluster.cfg.node_names
            )
            try:
                core.read_namespaced_service_account("default", JOBS_NAMESPACE)
                has_sa = True
            except ApiException:
                has_sa = False
            if ready and has_sa:
                return
            time.sleep(0.3)
        raise StackError(
            f"Kubernetes nodes not Ready or no default ServiceAccount after {timeout_s:.0f}s "
            f"(see {cluster.dir / 'log'}/kwok.log and controllers.log)"
        )
    finally:
        api.close()


#: taints the node lifecycle controller sets while a node has no (or no fresh) Ready heartbeat.
HEARTBEAT_TAINTS = ("node.kubernetes.io/not-ready=", "node.kubernetes.io/unreachable=")


def _heartbeat_tainted(taints: list[str]) -> bool:
    return any(t.startswith(HEARTBEAT_TAINTS) for t in taints)


def node_states(cluster: K8sCluster, api: Any = None) -> list[dict[str, Any]]:
    """Each stack node: ready, cordoned, TrainGuard's taint and the decision that evicted it."""
    from kubernetes import client

    own = api is None
    api = api or admin_client(cluster)
    try:
        out = []
        names = set(cluster.cfg.node_names)
        for n in client.CoreV1Api(api).list_node().items:
            if n.metadata.name not in names:
                continue
            conds = {c.type: c.status for c in (n.status.conditions or [])}
            taints = [f"{t.key}={t.value or ''}:{t.effect}" for t in (n.spec.taints or [])]
            ann = n.metadata.annotations or {}
            out.append(
                {
                    "name": n.metadata.name,
                    "ready": conds.get("Ready") == "True",
                    "cordoned": bool(n.spec.unschedulable),
                    "taints": taints,
                    "evicted_by": ann.get("trainguard.io/evicted-by", ""),
                }
            )
        return sorted(out, key=lambda n: int(n["name"][1:]))
    finally:
        if own:
            api.close()
