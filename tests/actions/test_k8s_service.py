"""The whole chain on a real Kubernetes API server: a decision on the real broker -> the action
service (the CLI, a real process, holding a leader Lease) -> the ``kubernetes`` executor -> the
node cordoned and tainted, the job's pods recreated with a standby in the evicted node's place
-> the job's processes running again.  No mocks: the session's private control plane
(``tests/k8s_fixture.py``), the embedded Kafka."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.actions.conftest import make_decision, send
from tests.k8s_fixture import admin, beat, ctx, make_spec, template
from tests.streams.harness import Watcher
from tests.waiting import wait_until
from trainguard.infra.config import Settings
from trainguard.infra.stack.k8s import K8sCluster
from trainguard.schemas.control import ActionEvent, ActionPhase
from trainguard.schemas.enums import Action

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_decision_cordons_the_node_and_a_standby_takes_its_pod(
    stack_settings: Settings, k8s_cluster: K8sCluster, k8s_job: Any, tmp_path: Path, actions_watch: Watcher
) -> None:
    name, ex, out = k8s_job
    active = ["n1", "n2", "n3"]
    ex.restart(make_spec(name, active), ctx("launch"))  # as the job's JobSet would have
    standbys = ex.provision_standbys(name, 1, ctx("standby"))
    wait_until(lambda: beat(out, "n2"), 30, "n2's process")

    lease = f"{name}-actions"
    config = tmp_path / "tg.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "actions": {
                    "group_id": f"tg-actions-{name}",
                    "jobs": [name],
                    "state_dir": str(tmp_path / "service-state"),
                    "poll_interval_s": 0.2,
                    "leader_lease": f"default/{lease}",
                    "leader_kubeconfig": str(k8s_cluster.admin_kubeconfig),
                    "executor": "kubernetes",
                    "executor_options": {
                        "kubeconfig": str(k8s_cluster.executor_kubeconfig),
                        "pod_template": template(out),
                        "standby_command": [sys.executable, "-c", "import signal; signal.pause()"],
                        "grace_period_s": 5,
                    },
                }
            }
        )
    )
    log = tmp_path / "service.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard", "actions"],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TRAINGUARD_CONFIG": str(config)},
            start_new_session=True,
        )
    coord = _coord(k8s_cluster)
    try:
        holder = wait_until(
            lambda: _holder(coord, lease), 120, lambda: f"the Lease taken; {log.read_text()[-2000:]}"
        )
        send(stack_settings, make_spec(name, active, standbys))
        decision = make_decision(name, Action.EVICT, ["n2"])
        send(stack_settings, decision)
        ended = {ActionPhase.SUCCEEDED, ActionPhase.FAILED, ActionPhase.HELD}
        final = actions_watch.wait_for(
            lambda e: (
                isinstance(e, ActionEvent)
                and e.decision_id == decision.decision_id
                and e.step == "recovery"
                and e.phase in ended
            ),
            timeout_s=150,
        )
        tail = log.read_text()[-3000:]
        assert isinstance(final, ActionEvent) and final.phase is ActionPhase.SUCCEEDED, tail
        # n2 cordoned and tainted by this decision; the standby's node runs n2's place (index 1).
        node = admin(k8s_cluster).read_node("n2")
        assert (
            node.spec.unschedulable
            and node.metadata.annotations["trainguard.io/evicted-by"] == decision.decision_id
        )
        assert any(t.key == "trainguard.io/evicted" and t.effect == "NoExecute" for t in node.spec.taints)
        # The standby's node had run no rank before: its first one is n2's place (index 1).
        b = wait_until(lambda: beat(out, standbys[0]), 60, "the rank on the standby")
        assert b["index"] == "1" and b["machines"] == f"n1,{standbys[0]},n3"
        pods = ex.pods(name, "train")
        assert sorted(p.spec.node_selector["kubernetes.io/hostname"] for p in pods) == sorted(
            ["n1", standbys[0], "n3"]
        )
        assert not [p for p in pods if p.spec.node_selector["kubernetes.io/hostname"] == "n2"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0, log.read_text()[-2000:]
    assert holder and _holder(coord, lease) is None  # released on a clean stop


def _coord(cluster: K8sCluster) -> Any:
    from kubernetes import client, config

    return client.CoordinationV1Api(config.new_client_from_config(config_file=str(cluster.admin_kubeconfig)))


def _holder(coord: Any, name: str) -> str | None:
    from kubernetes.client.exceptions import ApiException

    try:
        return coord.read_namespaced_lease(name, "default").spec.holder_identity or None
    except ApiException:
        return None
