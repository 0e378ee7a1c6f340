"""``stack up --k8s``'s control plane, and the Kubernetes manifests applied to it (no mocks).

The cluster is the session's private one (tests/k8s_fixture.py: the stack's own start code in a
temporary home).  The manifests of ``infra/deploy/k8s`` are applied as a deployment would apply
them (server-side apply), first as a server-side dry run, then for real: kwok runs the DaemonSet's
and the Deployments' pods as far as a fake kubelet can (Running, Ready), which proves the objects
are valid and schedulable, not that the containers work (there is no image here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.k8s_fixture import NODES, admin
from tests.waiting import wait_until
from trainguard.infra.k8s.apply import ManifestError, apply_documents, load_documents
from trainguard.infra.k8s.bootstrap import DEPLOY_DIR
from trainguard.infra.stack.k8s import RACK_LABEL, ZONE_LABEL, K8sCluster, K8sConfig

pytestmark = pytest.mark.slow


def client_for(cluster: K8sCluster):  # type: ignore[no-untyped-def]
    from kubernetes import config

    return config.new_client_from_config(config_file=str(cluster.admin_kubeconfig))


def test_status_names_the_kubeconfig_and_every_node(k8s_cluster: K8sCluster) -> None:
    st = k8s_cluster.status()
    assert st["running"] and st["healthy"], st
    assert Path(st["kubeconfig"]).exists() and Path(st["executor_kubeconfig"]).exists()
    assert [n["name"] for n in st["nodes"]] == [f"n{i}" for i in range(1, NODES + 1)]
    assert all(n["ready"] and not n["cordoned"] for n in st["nodes"])
    assert all(pid for pid in st["pids"].values())


def test_nodes_carry_their_network_position(k8s_cluster: K8sCluster) -> None:
    nodes = {n.metadata.name: n for n in admin(k8s_cluster).list_node().items}
    cfg = K8sConfig()
    assert nodes["n1"].metadata.labels[ZONE_LABEL] == "pod-0"
    assert nodes["n7"].metadata.labels[ZONE_LABEL] == f"pod-{6 // cfg.nodes_per_pod}"
    assert nodes["n3"].metadata.labels[RACK_LABEL] == f"rack-{2 // cfg.nodes_per_rack}"
    assert nodes["n1"].status.capacity["nvidia.com/gpu"] == str(cfg.gpus_per_node)


def test_the_api_server_reports_the_release_it_was_built_at(k8s_cluster: K8sCluster) -> None:
    from kubernetes import client

    from trainguard.infra.stack.k8s import K8S_VERSION

    info = client.VersionApi(client_for(k8s_cluster)).get_code()
    assert info.git_version == K8S_VERSION


def test_base_manifests_apply_server_side(k8s_cluster: K8sCluster) -> None:
    api = client_for(k8s_cluster)
    docs = load_documents(DEPLOY_DIR / "base")
    kinds = {d["kind"] for d in docs}
    assert {"DaemonSet", "Deployment", "ClusterRole", "RoleBinding", "ConfigMap", "PriorityClass"} <= kinds
    done = apply_documents(api, docs, dry_run=True)
    assert len(done) == len(docs)
    apply_documents(api, docs)
    apply_documents(api, docs)  # idempotent: a second apply changes nothing and fails nothing
    from kubernetes import client

    apps = client.AppsV1Api(api)

    def exporters_ready() -> bool:
        ds = apps.read_namespaced_daemon_set("trainguard-exporter", "trainguard").status
        return ds.desired_number_scheduled == NODES and ds.number_ready == NODES

    # The exporter tolerates every taint: one per node, cordoned (evicted) nodes included.
    wait_until(exporters_ready, 60, "an exporter pod Ready on every node")
    wait_until(
        lambda: apps.read_namespaced_deployment("trainguard-worker", "trainguard").status.ready_replicas == 2,
        60,
        "two worker replicas Ready",
    )
    actions = apps.read_namespaced_deployment("trainguard-actions", "trainguard")
    assert actions.spec.replicas == 1 and actions.spec.strategy.type == "Recreate"


def test_monitoring_manifests_apply_where_the_operator_crd_exists(k8s_cluster: K8sCluster) -> None:
    # The Prometheus Operator's CRD, reduced to what the API server needs to accept the objects
    # (the operator's own CRD validates the spec further: not checked here).
    crd = yaml.safe_load(
        """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: servicemonitors.monitoring.coreos.com}
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: {plural: servicemonitors, singular: servicemonitor, kind: ServiceMonitor, listKind: ServiceMonitorList}
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          x-kubernetes-preserve-unknown-fields: true
"""
    )
    api = client_for(k8s_cluster)
    apply_documents(api, [crd])
    apply_documents(api, load_documents(DEPLOY_DIR / "base" / "namespaces.yaml"))

    def applied() -> bool:
        try:
            apply_documents(api, load_documents(DEPLOY_DIR / "monitoring"), dry_run=True)
        except Exception:
            return False  # the CRD's API appears a moment after it is created
        return True

    wait_until(applied, 30, "the ServiceMonitors accepted (dry run)")


def test_the_reader_refuses_what_only_kustomize_would_do(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: [a.yaml]\nnamePrefix: x-\n")
    with pytest.raises(ManifestError, match="namePrefix"):
        load_documents(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("resources: [a.yaml]\n")
    (tmp_path / "a.yaml").write_text("kind: Pod\n")
    with pytest.raises(ManifestError, match="apiVersion"):
        load_documents(tmp_path)
