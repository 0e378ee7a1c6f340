"""``trainguard demo --cluster k8s``: the demo job as pods on the stack's private Kubernetes.

The same tiny-GPT job, faults, stream worker and summary as :mod:`trainguard_demo.run`, but the
cluster is the real Kubernetes control plane of ``trainguard stack up --k8s`` (kwok nodes
``n1..nN``) and recovery goes through the product's ``kubernetes`` executor:

* the demo's machines are Nodes: ``n1..n<machines>`` run the job, the next ``SPARES`` nodes are
  its pool (labelled ``trainguard.io/demo-pool=<job>``: standbys are placed there only);
* one exporter per pool node, as a DaemonSet (tolerating every taint, like the product's);
* the job is one pod per machine (:mod:`trainguard_demo.k8s_node` ``machine``: the machine's
  ranks, real trainer processes the stack's pod runner starts once kwok reports the pod
  Running); the demo creates the first set through the executor's own ``restart`` and its first
  standby through ``provision_standbys``, then publishes the job's spec, as an operator's
  launcher would;
* the action service cordons and taints an evicted node (``trainguard.io/evicted=<category>``,
  annotated with the decision), deletes its pods, removes a standby pod from the node that
  replaces it and recreates the job's pods there from the latest checkpoint; a code rollback
  patches the job's code ConfigMap; stop-time tests run as pods on the named nodes;
* the summary adds every pool node's state as the API server reports it (``kubectl get nodes``
  agrees).

No baseline job and no warm process pools: a restarted pod's ranks import torch cold, as under
Slurm.  Evicted nodes stay cordoned after the run, for ``kubectl describe node``; the next run
uncordons them.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import click
import yaml

from trainguard.actions.executors.base import ExecutorEnv, StepContext
from trainguard.actions.executors.kubernetes import (
    JOB_LABEL,
    KubernetesExecutor,
    KubernetesExecutorConfig,
    job_label,
)
from trainguard.infra.bus import EventProducer, signer_for
from trainguard.infra.config import Settings
from trainguard.infra.k8s.apply import apply_documents
from trainguard.infra.k8s.bootstrap import JOBS_NAMESPACE, node_states
from trainguard.infra.stack.k8s import K8sCluster
from trainguard.infra.stack.manager import Stack
from trainguard.infra.stack.podrunner import LOCAL_RUN_LABEL
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import JobSpec
from trainguard.schemas.topics import JOBS
from trainguard_demo.config import LaunchSpec, write_atomic
from trainguard_demo.k8s_node import standby_probe
from trainguard_demo.run import Demo, DemoConfig
from trainguard_demo.slurm_demo import SLURM_SCENARIO, write_reference
from trainguard_demo.slurm_node import base_spec_path

#: the faults the demo injects on Kubernetes by default: the Slurm demo's (evict + standby for
#: Xid and NIC down, an in-place restart for a crash, a rollback for a bad push, a group
#: eviction for a hang).
K8S_SCENARIO = SLURM_SCENARIO
#: pool nodes beyond the job's machines (the default scenario evicts up to five).
SPARES = 5
POOL_LABEL = "trainguard.io/demo-pool"
_PYTHON = sys.executable


class K8sDemo(Demo):
    """:class:`Demo` on the stack's Kubernetes; see the module docstring."""

    def __init__(self, settings: Settings, cfg: DemoConfig, scenario: list[dict[str, Any]], **kw: Any):
        super().__init__(settings, cfg, scenario, **kw)
        self.k8s: K8sCluster | None = None
        self.pool = [f"n{i}" for i in range(1, cfg.machines + SPARES + 1)]

    # -- configuration ----------------------------------------------------------------------------
    def _node_cmd(self, *args: str) -> list[str]:
        return [_PYTHON, "-m", "trainguard_demo.k8s_node", *args, "--cluster-dir", str(self.cluster)]

    def executor_options(self) -> dict[str, Any]:
        assert self.k8s is not None
        return {
            "kubeconfig": str(self.k8s.executor_kubeconfig),
            "namespace": JOBS_NAMESPACE,
            "pod_template": {
                "metadata": {"labels": {LOCAL_RUN_LABEL: "true", POOL_LABEL: self.job}},
                "spec": {
                    "containers": [
                        {
                            "name": "machine",
                            "image": "trainguard-demo:local",
                            "command": self._node_cmd("machine", "--job", self.job),
                        }
                    ]
                },
            },
            # A standby self-checks (the alignment test), then holds its node Ready; its ranks
            # start cold when it takes a place (no warm pools).
            "standby_command": self._node_cmd("standby"),
            "standby_readiness_probe": standby_probe(self.cluster),
            "standby_node_selector": {POOL_LABEL: self.job},
            "diagnostic_commands": {"alignment": self._node_cmd("check")},
            # The trainer's SIGTERM handler reports the exit and leaves at once.
            "grace_period_s": 5,
            # Restarted ranks import torch cold on two shared cores.
            "launch_timeout_s": 60.0,
        }

    def _config_file(self) -> Path:
        path = super()._config_file()
        config = yaml.safe_load(path.read_text())
        config["actions"]["executor"] = "kubernetes"
        config["actions"]["executor_options"] = self.executor_options()
        config["actions"]["min_standbys"] = 1
        path.write_text(yaml.safe_dump(config))
        return path

    def _exporters(self) -> dict[str, Any]:
        """The demo's exporter DaemonSet: one per pool node, every taint tolerated."""
        name = f"{self.job}-exporter"
        return {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": name, "namespace": JOBS_NAMESPACE},
            "spec": {
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": {"app": name, LOCAL_RUN_LABEL: "true"}},
                    "spec": {
                        "nodeSelector": {POOL_LABEL: self.job},
                        "tolerations": [{"operator": "Exists"}],
                        "terminationGracePeriodSeconds": 5,
                        "containers": [
                            {
                                "name": "exporter",
                                "image": "trainguard-demo:local",
                                "command": self._node_cmd("exporter", "--job", self.job),
                                "env": [
                                    {
                                        "name": "TRAINGUARD_NODE",
                                        "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                                    }
                                ],
                            }
                        ],
                    },
                },
            },
        }

    # -- the run ----------------------------------------------------------------------------------
    def _admin(self) -> Any:
        from kubernetes import client, config

        assert self.k8s is not None
        return client.CoreV1Api(config.new_client_from_config(config_file=str(self.k8s.admin_kubeconfig)))

    def _k8s_up(self) -> K8sCluster:
        need = len(self.pool)
        k8s = K8sCluster(self.settings.stack)
        if k8s.running() and k8s.cfg.nodes < need:
            raise click.ClickException(
                f"the stack's Kubernetes runs {k8s.cfg.nodes} nodes; the demo needs {need} "
                f"({self.cfg.machines} machines + {SPARES} spares): run `trainguard stack down` first"
            )
        report = Stack(self.settings).up(k8s=True, k8s_nodes=None if k8s.running() else max(need, 12))
        self.echo(f"[demo] stack with Kubernetes: {report.seconds:.1f}s; run dir {self.dir}")
        self.k8s = K8sCluster(self.settings.stack)
        core = self._admin()
        # An earlier run's evictions and pool labels: this private cluster's nodes are ours.
        for node in core.list_node().items:
            name = node.metadata.name
            labels = node.metadata.labels or {}
            taints = [
                t.to_dict()
                for t in (node.spec.taints or [])
                if t.key not in ("trainguard.io/evicted", "node.kubernetes.io/unschedulable")
            ]
            evicted = bool((node.metadata.annotations or {}).get("trainguard.io/evicted-by"))
            body: dict[str, Any] = {
                "metadata": {"labels": {POOL_LABEL: self.job if name in self.pool else None}}
            }
            if evicted or node.spec.unschedulable:
                body["metadata"]["annotations"] = {"trainguard.io/evicted-by": None}
                body["spec"] = {
                    "unschedulable": False,
                    "taints": [{k: v for k, v in t.items() if v is not None} for t in taints],
                }
                self.echo(f"[demo] {name} uncordoned (evicted by an earlier run)")
            if name in self.pool or POOL_LABEL in labels or "spec" in body:
                core.patch_node(name, body)
        return self.k8s

    def _ctx(self, step: str, seconds: float = 120.0) -> StepContext:
        return StepContext(
            decision_id=f"launch-{self.job}", step=step, attempt=1, deadline=time.monotonic() + seconds
        )

    def start(self) -> LaunchSpec:
        from trainguard.infra.stack.procs import port_in_use

        if port_in_use(self.cfg.web_port):
            raise click.ClickException(
                f"port {self.cfg.web_port} is in use: is another demo still running? (stop it first)"
            )
        self.k8s = self._k8s_up()
        c = self.cfg
        machines = self.pool[: c.machines]
        spec = LaunchSpec(
            job=self.job, cluster_dir=str(self.cluster), tp=c.tp, pp=c.pp, dp=c.dp,
            ranks_per_machine=c.ranks_per_machine, machines=machines, steps=c.steps, resume=True,
            pg_timeout_s=60.0,
        )  # fmt: skip
        (self.cluster / "jobs").mkdir(parents=True, exist_ok=True)
        write_atomic(base_spec_path(self.cluster, self.job), spec.to_json())
        write_atomic(self.cluster / "jobs" / f"{self.job}.json", spec.to_json())
        write_reference(self.cluster)
        env = {"TRAINGUARD_CONFIG": str(self._config_file())}
        self._spawn("worker", [*self._tg(), "worker"], env)
        self._spawn("actions", [*self._tg(), "actions", "run"], env)
        from kubernetes import config

        api = config.new_client_from_config(config_file=str(self.k8s.admin_kubeconfig))
        apply_documents(api, [self._exporters()])
        api.close()
        executor = KubernetesExecutor(
            KubernetesExecutorConfig(**self.executor_options()), ExecutorEnv(self.dir / "launch")
        )
        try:
            # The job's pods first (what its JobSet would create), then a standby on a free node
            # of the pool, then the spec with both, signed, as the job's operator publishes it.
            first = JobSpec(job=self.job, ts_ms=now_ms(), topology=spec.topology(), standbys=[])
            self._wait_worker()
            executor.restart(first, self._ctx("launch"))
            standbys = executor.provision_standbys(self.job, 1, self._ctx("standbys"))
            producer = EventProducer(self.settings.kafka, signer=signer_for(self.settings, "operator"))
            producer.send(
                JobSpec(job=self.job, ts_ms=now_ms(), topology=spec.topology(), standbys=standbys), JOBS
            )
            producer.flush()
            producer.close()
        finally:
            executor.close()
        self.echo(
            f"[demo] job {self.job}: tp{c.tp} pp{c.pp} dp{c.dp}, pods on {machines}, standby on "
            f"{standbys}, pool {self.pool[0]}..{self.pool[-1]}; recovery through the kubernetes executor"
        )
        self._wait_first_steps(
            f"{self.k8s.dir / 'pods'} and "
            f"`kubectl --kubeconfig {self.k8s.admin_kubeconfig} get pods -n {JOBS_NAMESPACE}`"
        )
        return spec

    def cluster_summary(self) -> dict[str, Any]:
        return {"k8s": self.k8s_state()}

    def k8s_state(self) -> dict[str, Any]:
        """The pool's nodes and the job's pods as the API server reports them now."""
        assert self.k8s is not None
        nodes = [n for n in node_states(self.k8s) if n["name"] in self.pool]
        pods = self._admin().list_namespaced_pod(
            JOBS_NAMESPACE, label_selector=f"{JOB_LABEL}={job_label(self.job)}"
        )
        return {
            "kubeconfig": str(self.k8s.admin_kubeconfig),
            "nodes": nodes,
            "pods": sorted(
                f"{p.metadata.name} {p.metadata.labels.get('trainguard.io/role', '')} "
                f"{p.spec.node_selector.get('kubernetes.io/hostname', '') if p.spec.node_selector else ''} "
                f"{p.status.phase}"
                for p in pods.items
            ),
        }

    def stop(self) -> None:
        # The services first (an action service still recovering would recreate pods), then the
        # job's pods and exporters: their processes are gone once the pods are.
        procs, self.procs = self.procs, []
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except Exception:
                proc.kill()
        if self.k8s is not None and self.k8s.running():
            from kubernetes import client, config

            api = config.new_client_from_config(config_file=str(self.k8s.admin_kubeconfig))
            apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
            with contextlib.suppress(client.exceptions.ApiException):
                apps.delete_namespaced_daemon_set(f"{self.job}-exporter", JOBS_NAMESPACE)
            for sel in (f"{JOB_LABEL}={job_label(self.job)}", f"app={self.job}-exporter"):
                core.delete_collection_namespaced_pod(
                    JOBS_NAMESPACE, label_selector=sel, grace_period_seconds=5
                )
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                left = [
                    p
                    for sel in (f"{JOB_LABEL}={job_label(self.job)}", f"app={self.job}-exporter")
                    for p in core.list_namespaced_pod(JOBS_NAMESPACE, label_selector=sel).items
                ]
                if not left:
                    break
                time.sleep(0.5)
            api.close()
        self.procs = procs
        super().stop()


def print_k8s(summary: dict[str, Any], echo: Any = click.echo) -> None:
    """The pool's nodes: which were cordoned and tainted, and by which decision."""
    k8s = summary.get("k8s")
    if not k8s:
        return
    echo(f"\nKubernetes nodes at the end (kubectl --kubeconfig {k8s['kubeconfig']} get nodes agrees)")
    for n in k8s["nodes"]:
        state = ("Ready" if n["ready"] else "NotReady") + (",SchedulingDisabled" if n["cordoned"] else "")
        ours = [t for t in n["taints"] if t.startswith("trainguard.io/")]
        echo(f"  {n['name']:<4} {state:<26} {' '.join(ours):<48} {n['evicted_by']}")
    if k8s.get("pods"):
        echo("Pods: " + "; ".join(k8s["pods"]))
