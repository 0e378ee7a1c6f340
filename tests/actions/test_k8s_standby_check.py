"""Warm standbys on Kubernetes self-check: Ready only while their probe passes, and a node whose
check fails is cordoned for repair while another free node takes the standby.

Real API server, kwok kubelets and the stack's pod runner (which runs the standby's command and
its exec readiness probe as processes, as a kubelet's runtime and prober would).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.k8s_fixture import admin, clean_up, ctx, make_spec, template
from tests.waiting import wait_until
from trainguard.actions.errors import PermanentError
from trainguard.actions.executors.base import ExecutorEnv
from trainguard.actions.executors.kubernetes import (
    EVICT_TAINT,
    EVICTED_BY,
    JOB_LABEL,
    SELF_CHECK,
    SELF_CHECK_FAILED,
    KubernetesExecutor,
    KubernetesExecutorConfig,
    job_label,
)
from trainguard.infra.stack.k8s import K8sCluster

pytestmark = pytest.mark.slow

CHECK = Path(__file__).resolve().parents[1] / "fixtures" / "k8s" / "standby_check.py"


@pytest.fixture
def checked(k8s_cluster: K8sCluster, tmp_path: Path) -> Any:
    out = tmp_path / "check"
    out.mkdir()
    cfg = KubernetesExecutorConfig(
        kubeconfig=str(k8s_cluster.executor_kubeconfig),
        pod_template=template(out),
        standby_command=[sys.executable, str(CHECK), str(out)],
        standby_readiness_probe={
            "exec": {"command": ["sh", "-c", f'test -f "{out}/$TRAINGUARD_NODE.ready"']},
            "periodSeconds": 1,
            "failureThreshold": 1,
        },
        grace_period_s=2,
        poll_s=0.1,
        provision_timeout_s=30,
    )
    ex = KubernetesExecutor(cfg, ExecutorEnv(state_dir=tmp_path / "state"))
    name = f"job-{tmp_path.name[-6:].lower().replace('_', '-')}"
    yield name, ex, out
    clean_up(k8s_cluster, name)
    ex.close()


def _pod_ready(core: Any, job: str, node: str) -> bool | None:
    """The Ready condition of ``job``'s standby pod on ``node`` (None: no Running pod there)."""
    for p in core.list_namespaced_pod("training", label_selector=f"{JOB_LABEL}={job_label(job)}").items:
        if (p.spec.node_selector or {}).get("kubernetes.io/hostname") == node and p.status.phase == "Running":
            return any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
    return None


def test_a_failed_self_check_cordons_the_node_and_another_takes_the_standby(
    k8s_cluster: K8sCluster, checked: Any
) -> None:
    name, ex, out = checked
    core = admin(k8s_cluster)
    step = ctx("replenish", seconds=60)
    first, second = ex._free_nodes(step)[:2]
    (out / "fail").write_text(f"{first}\n")
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(ex.provision_standbys(name, 1, step)), daemon=True)
    t.start()
    # The replacement runs but is not Ready until its check passes.
    wait_until(lambda: _pod_ready(core, name, second) is False, 30, f"the standby on {second} running")
    node = core.read_node(first)
    assert node.spec.unschedulable
    assert [(t.key, t.value, t.effect) for t in node.spec.taints or [] if t.key == EVICT_TAINT] == [
        (EVICT_TAINT, SELF_CHECK_FAILED, "NoExecute")
    ]
    assert node.metadata.annotations[EVICTED_BY] == step.op_id
    assert "exit 3" in node.metadata.annotations[SELF_CHECK]
    # Not Ready for a few probe periods: provisioning is still waiting.
    t.join(2.5)
    assert t.is_alive() and _pod_ready(core, name, second) is False
    (out / f"allow-{second}").touch()
    t.join(30)
    assert got == [[second]]
    spec = make_spec(name, ["n1"], [second])
    assert ex.ready_standbys(spec, [second]) == [second]
    # A standby whose check stops passing is no longer counted ready.
    (out / f"{second}.ready").unlink()
    wait_until(lambda: ex.ready_standbys(spec, [second]) == [], 15, "the standby to turn not Ready")


def test_a_standby_command_that_cannot_run_cordons_nothing(k8s_cluster: K8sCluster, checked: Any) -> None:
    name, ex, _ = checked
    broken = KubernetesExecutor(replace(ex.cfg, standby_command=["/nonexistent/self-check"]), ex.env)
    step = ctx("replenish", seconds=60)
    with pytest.raises(PermanentError, match="cannot run"):
        broken.provision_standbys(name, 1, step)
    assert not [n.metadata.name for n in admin(k8s_cluster).list_node().items if n.spec.unschedulable]
    broken.close()


def test_many_failed_checks_stop_for_an_operator(k8s_cluster: K8sCluster, checked: Any) -> None:
    name, ex, out = checked
    step = ctx("replenish", seconds=60)
    (out / "fail").write_text("\n".join(ex._free_nodes(step)) + "\n")
    with pytest.raises(PermanentError, match="operator must look at the check"):
        ex.provision_standbys(name, 1, step)
    cordoned = [n.metadata.name for n in admin(k8s_cluster).list_node().items if n.spec.unschedulable]
    assert len(cordoned) == ex.cfg.standby_self_check_max_failures
