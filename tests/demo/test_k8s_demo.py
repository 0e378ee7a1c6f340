"""``trainguard demo --cluster k8s`` end to end: the demo job as pods on the stack's real private
Kubernetes, faults injected, recovery through the action service's kubernetes executor (no
mocks: real Kafka, ClickHouse, API server, scheduler, controller manager, kwok nodes, PyTorch
ranks).  Two faults keep it to a few minutes: an Xid (the node cordoned and tainted with the
decision in its annotation, a standby's node takes its pod) and a crash (a stop-time test pod)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.demo.helpers import run_demo
from trainguard.actions.executors.kubernetes import JOB_LABEL, job_label
from trainguard.infra.config import Settings
from trainguard.infra.stack.k8s import K8sCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_demo_on_kubernetes_cordons_the_xid_node_and_recovers_both_faults(
    stack_settings: Settings, tmp_path: Path
) -> None:
    summary, res = run_demo("k8s", tmp_path)
    # The summary's node table and the API server agree: n1 cordoned, tainted, annotated.
    nodes = {n["name"]: n for n in summary["k8s"]["nodes"]}
    assert (
        nodes["n1"]["cordoned"] and "trainguard.io/evicted=gpu_unavailable:NoExecute" in nodes["n1"]["taints"]
    )
    from kubernetes import client, config

    cluster = K8sCluster(stack_settings.stack)
    core = client.CoreV1Api(config.new_client_from_config(config_file=str(cluster.admin_kubeconfig)))
    n1 = core.read_node("n1")
    assert (
        n1.spec.unschedulable
        and n1.metadata.annotations["trainguard.io/evicted-by"] == nodes["n1"]["evicted_by"]
    )
    # The job's pods ran on n2-n4 and a pool node at the end; the demo removed them when it stopped.
    assert not core.list_namespaced_pod(
        "training", label_selector=f"{JOB_LABEL}={job_label(summary['job'])}"
    ).items
    assert "Kubernetes nodes at the end" in res.stdout
