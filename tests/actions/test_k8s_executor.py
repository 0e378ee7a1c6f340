"""The kubernetes executor against a real API server (the stack's own, in a private home).

kube-apiserver, etcd, the scheduler and the controller manager are real; kwok plays the
kubelets and the stack's pod runner runs each pod's command as a process, so "the job's pods are
gone" is checked on the processes too.  The executor authenticates as the local stack's
``trainguard-executor`` user, which has exactly the roles ``infra/deploy/k8s/base/rbac.yaml``
grants a deployment's action service -- so these tests also prove those roles are enough, and
``test_rbac_denies_the_rest`` that they are not more.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.k8s_fixture import admin, alive, beat, clean_up, ctx, make_spec
from tests.waiting import wait_until
from trainguard.actions.errors import PermanentError, TemporaryError
from trainguard.actions.executors.base import ExecutorEnv
from trainguard.actions.executors.kubernetes import (
    EVICT_TAINT,
    EVICTED_BY,
    JOB_LABEL,
    JOB_NAME,
    KubernetesExecutor,
    KubernetesExecutorConfig,
    _label_value,
    classify,
    job_label,
)
from trainguard.infra.stack.k8s import K8sCluster

pytestmark = pytest.mark.slow


def test_evict_cordons_taints_and_a_standby_takes_the_rank(k8s_cluster: K8sCluster, k8s_job: Any) -> None:
    name, ex, out = k8s_job
    spec = make_spec(name, ["n1", "n2", "n3"])
    ex.restart(spec, ctx("restart"))
    for i, node in enumerate(["n1", "n2", "n3"]):
        b = wait_until(lambda node=node: beat(out, node), 30, f"the process of {node}")
        assert b["index"] == str(i) and b["machines"] == "n1,n2,n3" and b["restart"] == "1"
    old_pid = beat(out, "n2")["pid"]  # type: ignore[index]

    standbys = ex.provision_standbys(name, 2, ctx("replenish"))
    assert len(standbys) == 2 and not set(standbys) & {"n1", "n2", "n3"}
    for s in standbys:
        wait_until(lambda s=s: beat(out, s, "standby"), 30, f"the standby process on {s}")
    spec = make_spec(name, ["n1", "n2", "n3"], standbys)
    assert ex.ready_standbys(spec, standbys) == standbys

    decision = f"dec-{uuid.uuid4().hex[:8]}"
    ex.stop(spec, ctx("stop", decision))
    assert not ex.pods(name, "train")
    evict = ctx("evict", decision, category="gpu_unavailable")
    ex.evict(spec, ["n2"], evict)
    node = admin(k8s_cluster).read_node("n2")
    assert node.spec.unschedulable is True
    # The node controller adds its own node.kubernetes.io/unschedulable taint to a cordoned node.
    ours = [(t.key, t.value, t.effect) for t in node.spec.taints if t.key.startswith("trainguard.io")]
    assert ours == [(EVICT_TAINT, "gpu_unavailable", "NoExecute")]
    assert node.metadata.annotations[EVICTED_BY] == decision
    assert not alive(old_pid), "a deleted pod's process must be gone when the pod is"
    ex.evict(spec, ["n2"], evict)  # the same step again: a no-op
    assert "cordon" in ex.detail(evict.op_id)

    swap = ctx("swap", decision)
    ex.activate_standbys(spec, [standbys[0]], ["n2"], swap)
    new = make_spec(name, ["n1", standbys[0], "n3"], standbys[1:])
    restart = ctx("restart", decision)
    ex.restart(new, restart)
    ex.restart(new, restart)  # idempotent: no second set of pods
    pods = ex.pods(name, "train")
    assert sorted(p.spec.node_selector["kubernetes.io/hostname"] for p in pods) == sorted(
        new.topology.machines
    )
    b = wait_until(
        lambda: (x := beat(out, standbys[0])) and x["restart"] == "2" and x,
        30,
        "the rank on the standby's node",
    )
    assert b["index"] == "1" and b["machines"] == f"n1,{standbys[0]},n3"
    assert all(p.status.phase == "Running" for p in pods)
    # The other standby is still there and still ready.
    assert ex.ready_standbys(new, standbys[1:]) == standbys[1:]


def test_a_standby_never_takes_a_node_of_its_job(k8s_cluster: K8sCluster, k8s_job: Any) -> None:
    """A stopped job's nodes hold no pod, but they are still its nodes: no standby goes there."""
    name, ex, _ = k8s_job
    spec = make_spec(name, ["n1", "n2", "n3", "n4", "n5", "n6"])
    ex.restart(spec, ctx("restart"))
    ex.stop(spec, ctx("stop"))
    assert ex.provision_standbys(name, 1, ctx("replenish")) == ["n7"]


def test_evict_refuses_nodes_outside_the_job(k8s_cluster: K8sCluster, k8s_job: Any) -> None:
    name, ex, _ = k8s_job
    spec = make_spec(name, ["n1", "n2"], ["n3"])
    with pytest.raises(PermanentError, match="not nodes of job"):
        ex.evict(spec, ["n2", "n7"], ctx("evict"))
    for n in ("n2", "n7"):  # nothing was touched, not even the job's own node
        assert not admin(k8s_cluster).read_node(n).spec.unschedulable


def test_diagnostics_run_on_an_evicted_node(k8s_cluster: K8sCluster, k8s_job: Any) -> None:
    name, ex, _ = k8s_job
    spec = make_spec(name, ["n4", "n5"])
    ex.evict(spec, ["n4"], ctx("evict", category="xid"))
    results = ex.run_diagnostics(spec, ["n4", "n5"], ["ok", "broken"], ctx("diagnose", seconds=60))
    got = {(r.machine, r.test): (r.passed, r.detail) for r in results}
    assert got[("n4", "ok")] == (True, "exit 0") and got[("n5", "ok")] == (True, "exit 0")
    assert got[("n4", "broken")] == (False, "exit 3") and got[("n5", "broken")][0] is False
    assert not [p for p in ex.pods(name) if p.metadata.labels["trainguard.io/role"] == "diag"]
    with pytest.raises(PermanentError, match="no replay_command"):
        ex.run_replay(spec, [["n5"]], ctx("replay"))


def test_hot_update_reaches_the_restarted_pods(k8s_cluster: K8sCluster, k8s_job: Any) -> None:
    name, ex, out = k8s_job
    spec = make_spec(name, ["n6"])
    ex.hot_update(spec, "v2", ctx("hot_update"))
    ex.hot_update(spec, "v2", ctx("hot_update"))  # again: patched, not a conflict
    assert ex.code_version(name) == "v2"
    ex.restart(spec, ctx("restart"))
    b = wait_until(lambda: beat(out, "n6"), 30, "the rank")
    assert b["version"] == "v2"
    ex.hot_update(spec, "v1", ctx("rollback"))
    ex.restart(spec, ctx("restart-2"))  # no stop before: the old pod is replaced
    wait_until(lambda: (x := beat(out, "n6")) and x["version"] == "v1", 30, "the rolled-back rank")
    assert len(ex.pods(name, "train")) == 1


def test_jobs_whose_names_share_63_characters_never_touch_each_other(
    k8s_cluster: K8sCluster, k8s_job: Any
) -> None:
    """Issue #38: the job label once was the name cut to 63 characters, so stopping one of two
    such jobs deleted the other's pods.  Now it is a hash, the full name in an annotation; pods an
    older executor labelled the old way still count, each by its own ``TRAINGUARD_JOB``."""
    name, ex, _ = k8s_job
    a, b = f"{name}-{'x' * 60}-a", f"{name}-{'x' * 60}-b"
    assert _label_value(a) == _label_value(b) and job_label(a) != job_label(b)
    try:
        ex.restart(make_spec(a, ["n5"]), ctx("restart"))
        ex.restart(make_spec(b, ["n7"]), ctx("restart"))
        (pod,) = ex.pods(b, "train")
        assert pod.metadata.annotations[JOB_NAME] == b and pod.metadata.labels[JOB_LABEL] == job_label(b)
        ex.stop(make_spec(a, ["n5"]), ctx("stop"))
        assert not ex.pods(a) and [p.metadata.name for p in ex.pods(b, "train")] == [pod.metadata.name]

        # Pods of both jobs as an older executor made them: the old label, no annotation.
        core = admin(k8s_cluster)
        old = {}
        for job, node in ((a, "n5"), (b, "n7")):
            body = ex._train_pod(make_spec(job, [node]), 0, node, 1, ctx("old-restart"))
            body["metadata"]["name"] = f"{name}-old-{node}"
            body["metadata"]["labels"][JOB_LABEL] = _label_value(job)
            del body["metadata"]["annotations"][JOB_NAME]
            old[job] = core.create_namespaced_pod("training", body).metadata.name
        ex2 = KubernetesExecutor(ex.cfg, ex.env)  # a fresh service: looks for old-style pods again
        assert [p.metadata.name for p in ex2.pods(a)] == [old[a]]
        assert sorted(p.metadata.name for p in ex2.pods(b)) == sorted([pod.metadata.name, old[b]])
        ex2.stop(make_spec(a, ["n5"]), ctx("stop"))
        assert not ex2.pods(a)
        assert sorted(p.metadata.name for p in ex2.pods(b)) == sorted([pod.metadata.name, old[b]])
    finally:
        for job in (a, b):
            clean_up(k8s_cluster, job)
            core = admin(k8s_cluster)
            core.delete_collection_namespaced_pod(
                "training", label_selector=f"{JOB_LABEL}={_label_value(job)}", grace_period_seconds=0
            )


def test_errors_are_classified(k8s_cluster: K8sCluster, k8s_job: Any, tmp_path: Path) -> None:
    name, ex, _ = k8s_job
    # An invalid pod (no image): the API's 422, permanent, its message quoted.
    bad = KubernetesExecutor(
        KubernetesExecutorConfig(
            kubeconfig=str(k8s_cluster.executor_kubeconfig),
            pod_template={"spec": {"containers": [{"name": "main", "command": ["true"]}]}},
        ),
        ExecutorEnv(state_dir=tmp_path / "bad"),
    )
    with pytest.raises(PermanentError, match=r"422.*image"):
        bad.restart(make_spec(name, ["n7"]), ctx("restart"))
    bad.close()
    # A node that does not exist: 404, permanent.
    with pytest.raises(PermanentError, match="404"):
        ex.evict(make_spec(name, ["n99"]), ["n99"], ctx("evict"))
    # The API server unreachable: temporary.
    kc = tmp_path / "dead.kubeconfig"
    kc.write_text(
        k8s_cluster.executor_kubeconfig.read_text().replace(k8s_cluster.server, "https://127.0.0.1:1")
    )
    dead = KubernetesExecutor(
        KubernetesExecutorConfig(kubeconfig=str(kc), api_timeout_s=2), ExecutorEnv(tmp_path / "d")
    )
    with pytest.raises(TemporaryError, match="unreachable"):
        dead.stop(make_spec(name, ["n1"]), ctx("stop"))
    dead.close()


def test_classify_statuses() -> None:
    class Exc:
        def __init__(self, status: int) -> None:
            self.status, self.reason, self.body = status, "r", json.dumps({"message": f"m{status}"})

    assert isinstance(classify(Exc(403), "x"), PermanentError)
    assert isinstance(classify(Exc(422), "x"), PermanentError)
    for s in (409, 429, 500, 503):
        assert isinstance(classify(Exc(s), "x"), TemporaryError)
    assert "m403" in str(classify(Exc(403), "x"))


def test_rbac_denies_the_rest(k8s_cluster: K8sCluster) -> None:
    """The executor's user may do what the executor needs and nothing else."""
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    api = config.new_client_from_config(config_file=str(k8s_cluster.executor_kubeconfig))
    core, authz = client.CoreV1Api(api), client.AuthorizationV1Api(api)

    def can(verb: str, resource: str, namespace: str = "", sub: str = "") -> bool:
        review = authz.create_self_subject_access_review(
            {
                "spec": {
                    "resourceAttributes": {
                        "verb": verb, "resource": resource, "namespace": namespace, "subresource": sub
                    }
                }
            }
        )  # fmt: skip
        return bool(review.status.allowed)

    for verb in ("get", "list", "watch", "patch"):
        assert can(verb, "nodes")
    for verb in ("get", "list", "watch", "create", "delete"):
        assert can(verb, "pods", "training")
    for verb in ("get", "create", "patch"):
        assert can(verb, "configmaps", "training")
    denied = [
        ("delete", "nodes", ""),
        ("create", "nodes", ""),
        ("update", "nodes", ""),
        ("get", "secrets", "training"),
        ("list", "secrets", ""),
        ("create", "pods", "kube-system"),
        ("delete", "pods", "default"),
        ("patch", "pods", "training"),
        ("delete", "configmaps", "training"),
        ("create", "clusterrolebindings", ""),
        ("delete", "namespaces", ""),
        ("create", "pods/exec", "training"),
        ("create", "events", "training"),
    ]
    for verb, resource, ns in denied:
        res, _, sub = resource.partition("/")
        assert not can(verb, res, ns, sub), f"{verb} {resource} in {ns or 'the cluster'} must be denied"
    # And for real, not only in a review: the API refuses.
    with pytest.raises(ApiException) as err:
        core.delete_node("n8")
    assert err.value.status == 403
    with pytest.raises(ApiException) as err:
        core.list_namespaced_secret("training")
    assert err.value.status == 403
    api.close()


def test_positions_from_node_labels_and_a_standby_where_the_planner_asks(
    k8s_cluster: K8sCluster, k8s_job: Any
) -> None:
    """Topology-aware placement on the real API server: the nodes' pod and rack come from their
    labels (Topograph's spine/leaf keys where set, else the zone the stack gives every node:
    pod-0 for n1-n6, pod-1 from n7), and a standby starts on the node the planner names, not on
    the first free one."""
    from trainguard.actions.positions import POD_LABELS, RACK_LABELS

    name, ex, out = k8s_job
    core = admin(k8s_cluster)
    spine, leaf = POD_LABELS[0], RACK_LABELS[0]
    labels = {"n1": {spine: "spine-a", leaf: "leaf-1"}, "n2": {spine: "spine-a", leaf: "leaf-2"}}
    try:
        for node, values in labels.items():
            core.patch_node(node, {"metadata": {"labels": values}})
        pos = ex.machine_positions(["n1", "n2", "n3", "n7"])
        assert {m: (p.pod, p.rack) for m, p in pos.items()} == {
            "n1": ("spine-a", "leaf-1"),
            "n2": ("spine-a", "leaf-2"),
            "n3": ("pod-0", ""),
            "n7": ("pod-1", ""),
        }
        spec = make_spec(name, ["n1", "n2"])
        ex.restart(spec, ctx("restart"))
        free = ex.free_machines(name)
        assert "n7" in free and not {"n1", "n2"} & set(free)
        assert free.index("n7") > 0  # not the first free node: the planner's choice, not the order
        assert ex.provision_standbys_on(name, ["n7"], ctx("replenish")) == ["n7"]
        wait_until(lambda: beat(out, "n7", "standby"), 30, "the standby process on n7")
    finally:
        for node, values in labels.items():
            core.patch_node(node, {"metadata": {"labels": dict.fromkeys(values)}})
