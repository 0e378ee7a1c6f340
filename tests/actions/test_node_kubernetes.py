"""The Kubernetes side of a node's way back, against the API calls it makes (no cluster): the
uncordon and hold patches, the validation pod, and the verdict read from the pod's log and exit
code.  The API object answers with the client's own models (``kubernetes.client``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes.client import (
    V1ContainerState,
    V1ContainerStateTerminated,
    V1ContainerStatus,
    V1Node,
    V1NodeSpec,
    V1ObjectMeta,
    V1Pod,
    V1PodStatus,
    V1Taint,
)
from kubernetes.client.exceptions import ApiException

from trainguard.actions.errors import SchedulerError, UnknownNode
from trainguard.actions.node_config import NodeReturnConfig
from trainguard.actions.node_kubernetes import KubernetesNodes, hold_body, uncordon_body
from trainguard.schemas.telemetry import CheckOutcome

PASSED = json.dumps({"test": "gemm-digest", "passed": True, "duration_s": 2.0})
FAILED = json.dumps({"test": "memory", "passed": False, "detail": "cpu: 3 bad words", "duration_s": 1.0})


def evicted_node() -> V1Node:
    return V1Node(
        metadata=V1ObjectMeta(name="n1", annotations={"trainguard.io/evicted-by": "dec-1"}),
        spec=V1NodeSpec(
            unschedulable=True,
            taints=[
                V1Taint(key="trainguard.io/evicted", value="xid", effect="NoExecute"),
                V1Taint(key="example.com/gpu", value="h200", effect="NoSchedule"),
            ],
        ),
    )


class Api:
    """The CoreV1Api calls the way back makes, on one node ``n1``; the validation pod ends with
    ``exit_code`` and prints ``log``."""

    def __init__(self, exit_code: int, log: str) -> None:
        self.exit_code, self.log = exit_code, log
        self.calls: list[tuple[str, Any]] = []

    def read_node(self, name: str) -> V1Node:
        if name != "n1":
            raise ApiException(status=404, reason="Not Found")
        return evicted_node()

    def patch_node(self, name: str, body: dict[str, Any]) -> None:
        self.calls.append(("patch_node", (name, body)))

    def create_namespaced_pod(self, namespace: str, body: dict[str, Any]) -> None:
        self.calls.append(("create", (namespace, body)))

    def read_namespaced_pod(self, name: str, namespace: str) -> V1Pod:
        term = V1ContainerStateTerminated(exit_code=self.exit_code)
        status = V1ContainerStatus(
            name="validate", image="i", image_id="", ready=False, restart_count=0,
            state=V1ContainerState(terminated=term),
        )  # fmt: skip
        phase = "Succeeded" if self.exit_code == 0 else "Failed"
        return V1Pod(status=V1PodStatus(phase=phase, container_statuses=[status]))

    def read_namespaced_pod_log(self, name: str, namespace: str) -> str:
        return self.log

    def delete_namespaced_pod(self, name: str, namespace: str, grace_period_seconds: int) -> None:
        self.calls.append(("delete", (name, namespace)))


CFG = NodeReturnConfig(scheduler="kubernetes", image="registry.local/trainguard:1", namespace="ops")


def test_uncordon_removes_only_what_trainguard_put_on_the_node() -> None:
    body = uncordon_body(evicted_node())
    assert body["spec"]["unschedulable"] is False
    assert [t["key"] for t in body["spec"]["taints"]] == ["example.com/gpu"]
    assert body["metadata"]["annotations"]["trainguard.io/evicted-by"] is None
    assert body["metadata"]["labels"] == {"trainguard.io/preflight": None}


def test_a_passing_validation_pod_runs_past_the_cordon_and_is_deleted() -> None:
    api = Api(0, f"some runtime warning\n{PASSED}\n")
    verdict = KubernetesNodes(CFG, api).validate("n1")
    assert verdict.outcome is CheckOutcome.PASSED
    (ns, pod), deleted = api.calls[0][1], api.calls[-1]
    assert ns == "ops" and pod["spec"]["nodeName"] == "n1"
    assert pod["spec"]["tolerations"] == [{"key": "trainguard.io/evicted", "operator": "Exists"}]
    assert pod["spec"]["containers"][0]["command"] == ["trainguard", "diag", "--level", "standard", "--json"]
    assert pod["spec"]["containers"][0]["image"] == "registry.local/trainguard:1"
    assert deleted == ("delete", (pod["metadata"]["name"], "ops"))


def test_a_failing_validation_is_failed_and_hold_keeps_the_cordon() -> None:
    api = Api(1, f"{PASSED}\n{FAILED}\n")
    nodes = KubernetesNodes(CFG, api)
    verdict = nodes.validate("n1")
    assert verdict.outcome is CheckOutcome.FAILED and verdict.failed_tests == ("memory",)
    nodes.hold("n1", f"trainguard validation: {verdict.reason}")
    assert api.calls[-1] == ("patch_node", ("n1", hold_body(f"trainguard validation: {verdict.reason}")))
    assert api.calls[-1][1][1]["spec"] == {"unschedulable": True}


def test_a_pod_that_printed_nothing_is_an_error_not_a_pass() -> None:
    verdict = KubernetesNodes(CFG, Api(0, "")).validate("n1")
    assert verdict.outcome is CheckOutcome.ERROR


def test_unknown_nodes_and_a_missing_image_are_clear_errors() -> None:
    with pytest.raises(UnknownNode, match="Kubernetes has no node 'n9'"):
        KubernetesNodes(CFG, Api(0, PASSED)).resume("n9")
    with pytest.raises(SchedulerError, match=r"nodes\.image is empty"):
        KubernetesNodes(NodeReturnConfig(scheduler="kubernetes"), Api(0, PASSED))
