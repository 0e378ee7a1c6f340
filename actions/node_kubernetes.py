"""Kubernetes side of a node's way back: validate a cordoned node with a pod pinned to it, then
uncordon it or keep it cordoned.

The cordon stays on while the node is tested: the validation pod names the node (``nodeName``:
past the scheduler and the cordon, as the executor's stop-time test pods do) and tolerates
TrainGuard's eviction taint, so nothing else lands on the node before it passed.  Its stdout is
the ``trainguard diag --json`` lines, judged as a preflight is.  :meth:`KubernetesNodes.resume`
uncordons it and removes what TrainGuard put on it (the eviction taint, the eviction and preflight
annotations and label); :meth:`KubernetesNodes.hold` keeps it cordoned with the reason annotated.

The API object is a ``kubernetes.client.CoreV1Api`` (or anything with its methods); the patch
bodies are plain functions, checked without a cluster.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import replace
from typing import Any

from trainguard.actions.errors import SchedulerError, UnknownNode
from trainguard.actions.executors.kubernetes import EVICT_TAINT, EVICTED_BY
from trainguard.actions.node_config import NodeReturnConfig
from trainguard.diag.preflight import Verdict, judge

#: the annotation with the reason a node is held (quarantine, failed validation).
HOLD_REASON = "trainguard.io/hold-reason"
#: the preflight's label and reason annotation (``trainguard preflight cordon`` sets them).
PREFLIGHT_LABEL = "trainguard.io/preflight"
PREFLIGHT_REASON = "trainguard.io/preflight-reason"
POLL_S = 2.0


def uncordon_body(node: Any) -> dict[str, Any]:
    """The patch returning ``node`` (a V1Node) to service: schedulable, without TrainGuard's taint,
    annotations and label (other taints stay)."""
    taints = [t.to_dict() for t in (node.spec.taints or []) if t.key != EVICT_TAINT]
    return {
        "spec": {"unschedulable": False, "taints": taints},
        "metadata": {
            # null deletes a key in a strategic merge patch
            "annotations": {EVICTED_BY: None, HOLD_REASON: None, PREFLIGHT_REASON: None},
            "labels": {PREFLIGHT_LABEL: None},
        },
    }


def hold_body(reason: str) -> dict[str, Any]:
    """The patch keeping a node out of service with ``reason``.

    >>> hold_body("trainguard quarantine: evicted 2 times in 14 days")["spec"]
    {'unschedulable': True}
    """
    return {"spec": {"unschedulable": True}, "metadata": {"annotations": {HOLD_REASON: reason[:1000]}}}


def pod_name(node: str, now_ms: int) -> str:
    """A validation pod's name: readable, unique per node and start.

    >>> pod_name("GPU_Node.01", 5)
    'tg-validate-gpu-node-01-dfcada76'
    """
    digest = hashlib.sha256(f"{node}\0{now_ms}".encode()).hexdigest()[:8]
    base = re.sub(r"[^a-z0-9-]+", "-", node.lower()).strip("-")[:40] or "x"
    return f"tg-validate-{base}-{digest}"


def validation_pod(name: str, node: str, image: str, argv: list[str]) -> dict[str, Any]:
    """The pod that runs ``argv`` on ``node``, past its cordon and TrainGuard's taint."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"trainguard.io/role": "validate"}},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "tolerations": [{"key": EVICT_TAINT, "operator": "Exists"}],
            "containers": [{"name": "validate", "image": image, "command": list(argv)}],
        },
    }


class KubernetesNodes:
    """Validate, uncordon and hold nodes through a ``CoreV1Api``."""

    name = "kubernetes"

    def __init__(self, cfg: NodeReturnConfig, api: Any) -> None:
        if not cfg.image:
            raise SchedulerError("nodes.image is empty: the validation pod needs an image with trainguard")
        self.cfg, self.api = cfg, api

    def node(self, node: str) -> Any:
        try:
            return self.api.read_node(node)
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                raise UnknownNode(f"Kubernetes has no node {node!r}") from None
            raise SchedulerError(f"reading node {node}: {exc}") from exc

    def validate(self, node: str) -> Verdict:
        self.node(node)
        name = pod_name(node, int(time.time() * 1000))
        ns = self.cfg.namespace
        self.api.create_namespaced_pod(ns, validation_pod(name, node, self.cfg.image, self.cfg.command()))
        t0 = time.monotonic()
        try:
            rc = self._wait(name)
            logs = self.api.read_namespaced_pod_log(name, ns) if rc != 124 else ""
        finally:
            try:
                self.api.delete_namespaced_pod(name, ns, grace_period_seconds=0)
            except Exception as exc:  # gone already, or the API away: the pod ends by itself
                if getattr(exc, "status", None) != 404:
                    raise SchedulerError(f"deleting validation pod {name}: {exc}") from exc
        lines, problems = _lines(logs)
        verdict = judge(lines, rc, problems, timeout_s=self.cfg.validate_timeout_s)
        return verdict if verdict.duration_s else replace(verdict, duration_s=time.monotonic() - t0)

    def _wait(self, name: str) -> int:
        """The validation container's exit code (124 when it ran past the limit)."""
        deadline = time.monotonic() + self.cfg.validate_timeout_s
        while time.monotonic() < deadline:
            pod = self.api.read_namespaced_pod(name, self.cfg.namespace)
            if pod.status.phase in ("Succeeded", "Failed"):
                for cs in pod.status.container_statuses or []:
                    term = cs.state.terminated if cs.state else None
                    if term is not None:
                        return int(term.exit_code)
                return 0 if pod.status.phase == "Succeeded" else 1
            time.sleep(POLL_S)
        return 124

    def resume(self, node: str) -> None:
        self.api.patch_node(node, uncordon_body(self.node(node)))

    def hold(self, node: str, reason: str) -> None:
        self.node(node)
        self.api.patch_node(node, hold_body(reason))


def _lines(text: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The diag result objects in a pod's log (other lines -- a runtime's warnings -- are skipped)."""
    out: list[dict[str, Any]] = []
    for raw in text.splitlines():
        raw = raw.strip()
        if not raw.startswith("{"):
            continue
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("test"), str) and "passed" in obj:
            out.append(obj)
    return out, ([] if out else ["the validation pod printed no diag result"])
