"""The Kubernetes executor: recovery steps on a Kubernetes cluster, through its API.

**Model.**  A training job is a set of pods in one namespace (``namespace``), one per machine
(node), as JobSet / PyTorchJob run them: pod *i* runs machine *i*'s ranks, pinned to node
``spec.topology.machines[i]`` by ``kubernetes.io/hostname``.  The pods are built from
``pod_template`` (a Pod manifest); the executor adds its labels, the node pin, the training
priority class and the environment a rank needs (``TRAINGUARD_JOB``, ``TRAINGUARD_MACHINE_INDEX``,
``TRAINGUARD_MACHINES`` in rank order, ``TRAINGUARD_NODE``, ``TRAINGUARD_RESTART``,
``TRAINGUARD_CODE_VERSION`` from the job's code ConfigMap).  Warm standbys are low-priority pods
(``standby_template``, priority class ``trainguard-standby``) pinned to free nodes: they hold the
node, self-check (their readiness probe: ``standby_readiness_probe``) and are preempted by a
training pod if still there.

* ``stop`` deletes the job's training pods and waits until they are gone (a pod is gone once its
  processes are: the kubelet's contract);
* ``evict`` cordons each node, taints it ``trainguard.io/evicted=<category>:NoExecute``, annotates
  it with the decision id and deletes the job's pods on it -- only nodes of the job (its machines
  and standbys), never anybody else's;
* ``provision_standbys`` starts standby pods on free nodes (``standby_node_selector``, Ready,
  schedulable, untainted, no pod of any TrainGuard job) and waits until they are Ready (their
  self-check passed); a standby whose self-check fails (its pod ends Failed) leaves its node
  cordoned and tainted ``trainguard.io/evicted=standby_self_check`` (annotated with the op and the
  check's message: the node goes to repair, not to a job) and another free node is tried;
  ``activate_standbys`` checks each standby's node and removes its standby pod, so the training
  pod ``restart`` creates takes the node at once;
* ``machine_positions`` reads a node's pod and rack from its labels (``topology_pod_labels``,
  ``topology_rack_labels``); ``free_machines`` / ``provision_standbys_on`` let the action service
  choose the standbys' nodes (:mod:`trainguard.actions.placement`);
* ``restart`` creates the job's pods on the spec's machines (fresh names per restart) and waits
  until each is Running;
* ``hot_update`` writes the version into the job's ConfigMap (``<job>-code``, key ``version``):
  the plan's restart then starts pods that read it;
* ``run_diagnostics`` / ``run_replay`` run ``diagnostic_commands`` / ``replay_command`` as pods
  on the named nodes (``nodeName``: past the cordon; tolerating TrainGuard's taint) and read
  their phase: Succeeded = passed.

Idempotence: every object the executor creates carries ``trainguard.io/op=<ctx.op_id>``; a step
run again finds what its first attempt created and finishes it.  Errors: the API unreachable,
throttled, a conflict or a 5xx, or a pod not Running by the deadline -> :class:`TemporaryError`;
403 (RBAC), 404 of a named node, 422 (invalid object), a node outside the job ->
:class:`PermanentError`, the API's own message quoted.  Every API call that changes something is
logged with its op id (``detail(op_id)``).

**Why the official client** (``kubernetes``, kubernetes-client/python): maintained by the
Kubernetes project with a release per Kubernetes minor (34.x = 1.34), kubeconfig, in-cluster
service-account and token auth built in, typed models for every object we touch; its calls are
blocking, which suits the executor (the service runs each step in a worker thread).  The RBAC it
needs is ``infra/deploy/k8s/base/rbac.yaml`` (nodes: get/list/watch/patch; in the jobs'
namespace pods: get/list/watch/create/delete, configmaps: get/create/patch).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from trainguard.actions.errors import PermanentError, TemporaryError
from trainguard.actions.executors.base import (
    DiagnosticResult,
    ExecutorEnv,
    ExecutorPlugin,
    StepContext,
    unconfigured_commands,
)
from trainguard.actions.positions import POD_LABELS, RACK_LABELS, positions_from_node_labels
from trainguard.schemas.control import JobSpec
from trainguard.schemas.network import MachinePosition
from trainguard.schemas.typecheck import bounds

log = logging.getLogger(__name__)

_SECONDS = bounds(0.1, 86_400)
T = TypeVar("T")

PREFIX = "trainguard.io"
JOB_LABEL = f"{PREFIX}/job"
#: the full job name of an object whose ``JOB_LABEL`` is a hash of it (:func:`job_label`).
JOB_NAME = f"{PREFIX}/job-name"
ROLE_LABEL = f"{PREFIX}/role"
OP_LABEL = f"{PREFIX}/op"
INDEX_LABEL = f"{PREFIX}/machine-index"
EVICT_TAINT = f"{PREFIX}/evicted"
EVICTED_BY = f"{PREFIX}/evicted-by"
SELF_CHECK = f"{PREFIX}/self-check"
SELF_CHECK_FAILED = "standby_self_check"
HOSTNAME = "kubernetes.io/hostname"
TRAIN, STANDBY, DIAG, REPLAY = "train", "standby", "diag", "replay"


@dataclass(frozen=True)
class KubernetesExecutorConfig:
    """Settings of the kubernetes executor (``actions.executor_options`` when ``executor: kubernetes``)."""

    #: kubeconfig file; empty: the in-cluster service account when in a pod, else ``$KUBECONFIG``
    #: or ``~/.kube/config``.
    kubeconfig: str = ""
    #: kubeconfig context; empty: its current context.
    context: str = ""
    #: the namespace of the training jobs' pods.
    namespace: str = "training"
    #: the Pod manifest of one machine of the job (``apiVersion/kind`` optional; metadata.name,
    #: the node pin and TrainGuard's labels and env are set by the executor).  Required for restart.
    pod_template: dict[str, Any] = field(default_factory=dict)
    #: the Pod manifest of a warm standby; empty: ``pod_template`` with ``standby_command``.
    standby_template: dict[str, Any] = field(default_factory=dict)
    #: command of a standby's container when ``standby_template`` is empty (its self-check, then wait).
    standby_command: list[str] = field(default_factory=lambda: ["sleep", "infinity"])
    #: readiness probe (a Probe manifest, e.g. ``{"exec": {"command": [...]}, "periodSeconds": 2}``)
    #: of a standby's container when ``standby_template`` is empty: the standby counts as ready only
    #: while it passes.  Empty: ready as soon as it runs.
    standby_readiness_probe: dict[str, Any] = field(default_factory=dict)
    #: nodes one provisioning may cordon for failed self-checks before it stops and asks an
    #: operator (more failing at once points at the check or its image, not at the nodes).
    standby_self_check_max_failures: int = field(default=2, metadata=bounds(1, 1000))
    #: labels a node must have to take a standby (empty: any free node).
    standby_node_selector: dict[str, str] = field(default_factory=dict)
    #: priority classes (infra/deploy/k8s/base/priorityclasses.yaml).
    training_priority_class: str = "trainguard-training"
    standby_priority_class: str = "trainguard-standby"
    #: grace period of deleted training pods (their SIGTERM handler may save a checkpoint).
    grace_period_s: int = field(default=10, metadata=bounds(0, 3600))
    #: stop-time test name -> command (argv) run in a pod on each node; exit 0 = passed.
    diagnostic_commands: dict[str, list[str]] = field(default_factory=lambda: {"launch": ["true"]})
    #: replay command (argv) run in a pod per group (``TRAINGUARD_MACHINES`` = the group);
    #: empty: the escalation ladder skips dual-phase replay (the job is restarted instead).
    replay_command: list[str] = field(default_factory=list)
    #: image of diagnostic and replay pods; empty: the pod template's first container's image.
    tools_image: str = ""
    #: ConfigMap holding the job's code version (``{job}`` replaced), key ``version``.
    code_configmap: str = "{job}-code"
    #: per-call API timeout, and how long pods may take to start / go / finish.
    api_timeout_s: float = field(default=10.0, metadata=_SECONDS)
    launch_timeout_s: float = field(default=60.0, metadata=_SECONDS)
    stop_timeout_s: float = field(default=60.0, metadata=_SECONDS)
    provision_timeout_s: float = field(default=60.0, metadata=_SECONDS)
    diagnostics_timeout_s: float = field(default=120.0, metadata=_SECONDS)
    replay_timeout_s: float = field(default=600.0, metadata=_SECONDS)
    poll_s: float = field(default=0.2, metadata=bounds(0.01, 60))
    #: API calls kept per op id for ``detail``.
    history: int = field(default=200, metadata=bounds(1, 100_000))
    #: node labels naming a node's pod (spine group) and rack (leaf switch), the first one set
    #: wins; read for the action service's topology-aware swaps (:mod:`trainguard.actions.placement`).
    topology_pod_labels: list[str] = field(default_factory=lambda: list(POD_LABELS))
    topology_rack_labels: list[str] = field(default_factory=lambda: list(RACK_LABELS))


def _dns(text: str, limit: int = 63) -> str:
    """A DNS-1123 label from ``text`` (lower case, ``-`` for anything else).

    >>> _dns("Job_A.1"), _dns("--x--")
    ('job-a-1', 'x')
    """
    out = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return out[:limit].rstrip("-") or "x"


def job_label(job: str) -> str:
    """The ``trainguard.io/job`` label value of ``job``'s objects: a readable prefix and 160 bits of
    the name's SHA-256, so two names never share a label (``a_b`` and ``A.b``, or two names alike
    in their first 63 characters -- the most a label value holds); the full name is in the
    ``trainguard.io/job-name`` annotation.  (A lossy mapping here once made restarting one job
    delete another's pods.)

    >>> job_label("llm-7b")
    'llm-7b-9e70a190da317a4755050e5e38d63ff6740fef50'
    >>> job_label("a_b") != job_label("a-b") and len(job_label("x" * 128)) <= 63
    True
    """
    return f"{_dns(job, 22)}-{hashlib.sha256(job.encode()).hexdigest()[:40]}"


def _object_name(text: str, limit: int = 253) -> str:
    """A DNS-1123 object name (a ConfigMap's) or file name for ``text``: ``text`` itself when it
    is one already (so the names of jobs made before stay), else its lossy DNS form plus a hash of
    ``text`` (``Job_A`` and ``job-a`` stay apart).  A name that ends like a hash itself is hashed
    too, so no name can be chosen to equal another one's hashed form.

    >>> _object_name("llm-code"), _object_name("LLM_code")[:9]
    ('llm-code', 'llm-code-')
    """
    if _dns(text, limit) == text and not _HASHED.search(text):
        return text
    return f"{_dns(text, limit - 33)}-{hashlib.sha256(text.encode()).hexdigest()[:32]}"


_HASHED = re.compile(r"-[0-9a-f]{32}$")


def _label_value(text: str) -> str:
    """A label (or taint) value from ``text``: 63 characters of ``[A-Za-z0-9._-]``, alphanumeric ends.

    >>> _label_value("gpu_unavailable"), _label_value("a b/c")
    ('gpu_unavailable', 'a_b_c')
    """
    out = re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:63]
    return out.strip("._-") or "unknown"


class KubernetesExecutor:
    """Recovery through the Kubernetes API; see the module docstring."""

    name = "kubernetes"

    def __init__(self, cfg: KubernetesExecutorConfig, env: ExecutorEnv) -> None:
        self.cfg = cfg
        self.env = env
        self.diagnostic_tests = tuple(cfg.diagnostic_commands)
        self._api: Any = None
        self._lock = threading.Lock()
        self._calls: dict[str, deque[str]] = {}
        self.state_dir = Path(env.state_dir) / "kubernetes"
        #: jobs without pods labelled the old way (:meth:`pods`): no longer looked for.
        self._no_legacy: set[str] = set()

    # -- the API -------------------------------------------------------------------------------
    def _client(self) -> Any:
        with self._lock:
            if self._api is None:
                from kubernetes import client, config

                try:
                    if self.cfg.kubeconfig:
                        api = config.new_client_from_config(
                            config_file=self.cfg.kubeconfig, context=self.cfg.context or None
                        )
                    else:
                        try:
                            config.load_incluster_config()
                            api = client.ApiClient()
                        except config.ConfigException:
                            api = config.new_client_from_config(context=self.cfg.context or None)
                except (config.ConfigException, OSError) as exc:
                    raise PermanentError(f"kubernetes: no usable kubeconfig: {exc}") from exc
                self._api = api
            return self._api

    @property
    def core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self._client())

    def _call(self, what: str, ctx: StepContext | None, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """One API call, its error classified; changes are remembered for ``detail``."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        timeout = self.cfg.api_timeout_s
        if ctx is not None:
            timeout = max(0.5, min(timeout, ctx.remaining() or 0.5))
        try:
            out = fn(*args, _request_timeout=timeout, **kw)
        except ApiException as exc:
            raise classify(exc, what) from exc
        except (HTTPError, OSError) as exc:
            raise TemporaryError(f"kubernetes: {what}: API unreachable: {exc}", delay=1.0) from exc
        if ctx is not None and not what.startswith(("list", "read", "get")):
            self._note(ctx.op_id, what)
        return out

    def _note(self, op_id: str, text: str) -> None:
        with self._lock:
            calls = self._calls.setdefault(op_id, deque(maxlen=self.cfg.history))
            calls.append(text)
        log.info("kubernetes [%s]: %s", op_id[:8], text)

    def detail(self, op_id: str, limit: int = 1500) -> str:
        """What the executor changed for step ``op_id`` (its API calls), for the action event."""
        with self._lock:
            text = "; ".join(self._calls.get(op_id, ()))
        return text if len(text) <= limit else text[: limit - 3] + "..."

    # -- reads ---------------------------------------------------------------------------------
    def pods(self, job: str, role: str | None = None, ctx: StepContext | None = None) -> list[Any]:
        """The pods of ``job`` (of ``role``): by the hashed label, each one's annotation naming
        exactly ``job``; and, until none is left, the pods an older executor labelled with the
        name itself (:func:`_label_value`, lossy), each one's ``TRAINGUARD_JOB`` naming ``job``."""
        role_sel = f",{ROLE_LABEL}={role}" if role else ""
        sel = f"{JOB_LABEL}={job_label(job)}{role_sel}"
        got = self._call(
            f"list pods {sel}", ctx, self.core.list_namespaced_pod, self.cfg.namespace, label_selector=sel
        )
        out = [p for p in got.items if (p.metadata.annotations or {}).get(JOB_NAME) == job]
        if job not in self._no_legacy:
            sel = f"{JOB_LABEL}={_label_value(job)}"
            legacy = self._call(
                f"list pods {sel}", ctx, self.core.list_namespaced_pod, self.cfg.namespace, label_selector=sel
            ).items
            legacy = [p for p in legacy if JOB_NAME not in (p.metadata.annotations or {})]
            if not legacy:
                self._no_legacy.add(job)  # the executor labels no pod this way any more
            out += [
                p
                for p in legacy
                if _env_job(p) == job and (not role or (p.metadata.labels or {}).get(ROLE_LABEL) == role)
            ]
        return out

    def node(self, name: str, ctx: StepContext | None = None) -> Any:
        return self._call(f"read node {name}", ctx, self.core.read_node, name)

    def nodes(self, ctx: StepContext | None = None) -> list[Any]:
        return list(self._call("list nodes", ctx, self.core.list_node).items)

    @staticmethod
    def usable(node: Any) -> str:
        """Why ``node`` cannot take a pod of the job ("" when it can)."""
        conds = {c.type: c.status for c in (node.status.conditions or [])}
        if conds.get("Ready") != "True":
            return "not Ready"
        if node.spec.unschedulable:
            return "cordoned"
        hard = [t.key for t in (node.spec.taints or []) if t.effect in ("NoSchedule", "NoExecute")]
        if hard:
            return f"tainted {','.join(hard)}"
        return ""

    # -- protocol ------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Check the API answers and the executor may list the jobs' pods (logged; recoveries retry
        on their own)."""
        try:
            self._call(
                f"list pods in {self.cfg.namespace}",
                None,
                self.core.list_namespaced_pod,
                self.cfg.namespace,
                limit=1,
            )
        except (TemporaryError, PermanentError) as exc:
            log.warning("kubernetes executor: %s", exc)

    def unconfigured(self) -> dict[str, str]:
        """Protocol methods this configuration cannot perform, and the option to set."""
        cfg = self.cfg
        return unconfigured_commands(
            cfg.replay_command, cfg.diagnostic_commands, ("pod_template", bool(cfg.pod_template))
        )

    def usable_machines(self, spec: JobSpec, candidates: list[str], ctx: StepContext) -> list[str]:
        """Of the job's nodes and ``candidates``, those Ready, schedulable and untainted now (a
        node an operator uncordoned and untainted is usable again)."""
        usable = {n.metadata.name for n in self.nodes(ctx) if not self.usable(n)}
        names = [*spec.topology.machines, *spec.standbys, *candidates]
        return [n for n in dict.fromkeys(names) if n in usable]

    def _remember(self, spec: JobSpec) -> None:
        """Record the job's latest machines and standbys: a new standby never goes to one of them."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        doc = {"machines": list(spec.topology.machines), "standbys": list(spec.standbys)}
        tmp = self.state_dir / f".{_dns(spec.job)}.json.tmp"
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.state_dir / f"{_dns(spec.job)}.json")

    def _known(self, job: str) -> set[str]:
        try:
            doc = json.loads((self.state_dir / f"{_dns(job)}.json").read_text())
        except (OSError, ValueError):
            return set()
        return set(doc.get("machines", [])) | set(doc.get("standbys", []))

    def stop(self, spec: JobSpec, ctx: StepContext) -> None:
        self._remember(spec)
        self._delete_pods(self.pods(spec.job, TRAIN, ctx), ctx)
        self._wait_gone(spec.job, TRAIN, None, ctx, self.cfg.stop_timeout_s)

    def evict(self, spec: JobSpec, machines: list[str], ctx: StepContext) -> None:
        ours = set(spec.topology.machines) | set(spec.standbys)
        outside = [m for m in machines if m not in ours]
        if outside:
            raise PermanentError(
                f"kubernetes: refusing to evict {outside}: not nodes of job {spec.job} "
                f"(machines and standbys: {sorted(ours)})"
            )
        self._remember(spec)
        value = _label_value(ctx.category or "fault")
        for name in machines:
            self._cordon(name, value, ctx.decision_id, {}, ctx)
            on_node = [p for p in self.pods(spec.job, None, ctx) if p.spec.node_name == name]
            self._delete_pods(on_node, ctx)
        self._wait_gone(spec.job, None, set(machines), ctx, self.cfg.stop_timeout_s)

    def _cordon(self, name: str, value: str, by: str, notes: dict[str, str], ctx: StepContext) -> None:
        """Cordon node ``name`` and taint it ``trainguard.io/evicted=<value>:NoExecute``, annotated
        with ``by`` (a decision or op id) and ``notes``; nothing if that was done already."""
        node = self.node(name, ctx)
        taints = [t for t in (node.spec.taints or []) if t.key != EVICT_TAINT]
        taint = {"key": EVICT_TAINT, "value": value, "effect": "NoExecute"}
        mine = [t for t in (node.spec.taints or []) if t.key == EVICT_TAINT]
        annotated = (node.metadata.annotations or {}).get(EVICTED_BY) == by
        if node.spec.unschedulable and mine and annotated:
            return
        body = {
            "metadata": {"annotations": {EVICTED_BY: by, **notes}},
            "spec": {
                "unschedulable": True,
                # A taint already there keeps its value: the first fault named the node's trouble.
                "taints": [_taint_dict(t) for t in taints] + [mine[0].to_dict() if mine else taint],
            },
        }
        self._call(
            f"cordon+taint node {name} ({EVICT_TAINT}={value}:NoExecute, by {by})",
            ctx,
            self.core.patch_node,
            name,
            body,
        )

    def machine_positions(self, names: list[str]) -> dict[str, MachinePosition]:
        """Pod and rack of the nodes ``names`` from their labels (``topology_*_labels``)."""
        wanted = set(names)
        labels = {n.metadata.name: n.metadata.labels or {} for n in self.nodes() if n.metadata.name in wanted}
        return positions_from_node_labels(labels, self.cfg.topology_pod_labels, self.cfg.topology_rack_labels)

    def free_machines(self, job: str) -> list[str]:
        """Nodes a new standby of ``job`` could start on now."""
        return [n for n in self._free_nodes(None) if n not in self._known(job)]

    def provision_standbys_on(self, job: str, machines: list[str], ctx: StepContext) -> list[str]:
        """Standbys on ``machines`` (those still free; other free nodes make up for the rest)."""
        return self._provision(job, len(machines), ctx, prefer=machines)

    def provision_standbys(self, job: str, count: int, ctx: StepContext) -> list[str]:
        return self._provision(job, count, ctx)

    def _provision(
        self, job: str, count: int, ctx: StepContext, prefer: list[str] | None = None
    ) -> list[str]:
        mine = [
            p for p in self.pods(job, STANDBY, ctx) if (p.metadata.labels or {}).get(OP_LABEL) == ctx.op_id
        ]
        got = [p.spec.node_selector.get(HOSTNAME) for p in mine if p.metadata.deletion_timestamp is None]
        need = count - len(got)
        if need > 0:
            free = [n for n in self._free_nodes(ctx) if n not in self._known(job)]
            if prefer:
                free = [n for n in prefer if n in free] + [n for n in free if n not in prefer]
            if not free:
                if not got:
                    raise PermanentError(
                        f"kubernetes: no free node for a standby of {job} (selector "
                        f"{self.cfg.standby_node_selector or 'any'}: all Ready, schedulable, untainted "
                        "nodes hold pods of TrainGuard jobs)"
                    )
                log.warning("kubernetes: only %d of %d standbys of %s found nodes", len(got), count, job)
            for name in free[:need]:
                self._create_pod(self._standby_pod(job, name, ctx), ctx)
                got.append(name)
        deadline = time.monotonic() + min(self.cfg.provision_timeout_s, ctx.remaining())
        while True:
            pods = [
                p
                for p in self.pods(job, STANDBY, ctx)
                if (p.metadata.labels or {}).get(OP_LABEL) == ctx.op_id
            ]
            for pod in pods:
                if pod.status.phase == "Failed" and pod.metadata.deletion_timestamp is None:
                    got = self._replace_failed_standby(job, pod, got, ctx)
            ready = {p.spec.node_selector.get(HOSTNAME) for p in pods if _ready(p)}
            if got and all(n in ready for n in got):
                return list(got)
            if not got:
                raise TemporaryError(
                    f"kubernetes: every standby of {job} failed its self-check and no free node is left",
                    delay=10.0,
                )
            if time.monotonic() > deadline:
                raise TemporaryError(
                    f"kubernetes: standbys of {job} on {sorted(set(got) - ready)} not Ready in time "
                    "(self-check not passed)",
                    delay=2.0,
                )
            time.sleep(self.cfg.poll_s)

    def _replace_failed_standby(self, job: str, pod: Any, got: list[str], ctx: StepContext) -> list[str]:
        """A standby whose self-check failed: its node is cordoned for repair and another free node
        (if any) gets a standby instead.  Returns the standbys' nodes now."""
        node = pod.spec.node_selector.get(HOSTNAME)
        why = _terminated(pod)
        code = _exit_code(pod)
        if code in (126, 127):
            raise PermanentError(
                f"kubernetes: the standby command of {job} cannot run on {node} ({why}): "
                "fix standby_command / standby_template; no node was cordoned"
            )
        failed = [
            n.metadata.name
            for n in self.nodes(ctx)
            if (n.metadata.annotations or {}).get(EVICTED_BY) == ctx.op_id
        ]
        if len(failed) >= self.cfg.standby_self_check_max_failures:
            raise PermanentError(
                f"kubernetes: standby self-checks of {job} failed on {sorted(failed)} and now on {node} "
                f"({why}); more than standby_self_check_max_failures="
                f"{self.cfg.standby_self_check_max_failures} failing points at the check itself: an "
                "operator must look at the check (its pod logs) before more nodes are cordoned"
            )
        log.warning(
            "kubernetes: standby of %s on %s failed its self-check (%s): node cordoned", job, node, why
        )
        self._cordon(node, SELF_CHECK_FAILED, ctx.op_id, {SELF_CHECK: why[:1000]}, ctx)
        self._delete_pods([pod], ctx)
        got = [n for n in got if n != node]
        free = [n for n in self._free_nodes(ctx) if n not in self._known(job) and n not in got]
        if free:
            self._create_pod(self._standby_pod(job, free[0], ctx), ctx)
            got.append(free[0])
        return got

    def ready_standbys(self, spec: JobSpec, standbys: list[str]) -> list[str]:
        """Standbys whose pod is Ready on a node that can take the job's pod now."""
        pods = {
            p.spec.node_selector.get(HOSTNAME): p
            for p in self.pods(spec.job, STANDBY)
            if p.metadata.deletion_timestamp is None
        }
        usable = {n.metadata.name for n in self.nodes() if not self.usable(n)}
        return [s for s in standbys if s in pods and _ready(pods[s]) and s in usable]

    def activate_standbys(
        self, spec: JobSpec, standbys: list[str], replaces: list[str], ctx: StepContext
    ) -> None:
        unknown = [s for s in standbys if s not in spec.standbys and s not in spec.topology.machines]
        if unknown:
            raise PermanentError(f"kubernetes: {unknown} are not standbys of {spec.job}")
        for name in standbys:
            node = self.node(name, ctx)
            why = self.usable(node)
            if why and _transient(node):
                # NotReady / unreachable come and go with the node's heartbeat: try again (the
                # service's next attempt takes another ready standby first, if there is one).
                raise TemporaryError(f"kubernetes: standby node {name} of {spec.job} is {why}", delay=5.0)
            if why:
                raise PermanentError(f"kubernetes: standby node {name} of {spec.job} is {why}")
        pods = [
            p for p in self.pods(spec.job, STANDBY, ctx) if p.spec.node_selector.get(HOSTNAME) in standbys
        ]
        self._delete_pods(pods, ctx, grace=0)
        self._wait_gone(spec.job, STANDBY, set(standbys), ctx, self.cfg.stop_timeout_s)

    def restart(self, spec: JobSpec, ctx: StepContext) -> None:
        if not self.cfg.pod_template:
            raise PermanentError("kubernetes: no pod_template configured: cannot start the job's pods")
        self._remember(spec)
        machines = list(spec.topology.machines)
        train = self.pods(spec.job, TRAIN, ctx)
        stale = [p for p in train if (p.metadata.labels or {}).get(OP_LABEL) != ctx.op_id]
        if stale:  # a restart without a stop before it (or an earlier attempt's leftovers)
            self._delete_pods(stale, ctx)
            self._wait_gone(spec.job, TRAIN, None, ctx, self.cfg.stop_timeout_s, keep_op=ctx.op_id)
        for name in machines:
            node = self.node(name, ctx)
            why = self.usable(node)
            if why and _transient(node):
                # A new node, or one whose heartbeat is late, carries the lifecycle controller's
                # not-ready taint for a while: try again rather than give the job up.
                raise TemporaryError(f"kubernetes: node {name} of {spec.job} is {why}", delay=5.0)
            if why:
                raise PermanentError(f"kubernetes: node {name} of {spec.job} is {why}: cannot restart on it")
        have = {
            (p.metadata.labels or {}).get(INDEX_LABEL)
            for p in train
            if (p.metadata.labels or {}).get(OP_LABEL) == ctx.op_id and p.metadata.deletion_timestamp is None
        }
        generation = self._generation(spec.job, ctx)
        for i, name in enumerate(machines):
            if str(i) not in have:
                self._create_pod(self._train_pod(spec, i, name, generation, ctx), ctx)
        deadline = time.monotonic() + min(self.cfg.launch_timeout_s, ctx.remaining())
        while True:
            pods = [
                p
                for p in self.pods(spec.job, TRAIN, ctx)
                if (p.metadata.labels or {}).get(OP_LABEL) == ctx.op_id
            ]
            failed = [p.metadata.name for p in pods if p.status.phase == "Failed"]
            if failed:
                raise TemporaryError(f"kubernetes: pods {failed} of {spec.job} failed at start", delay=1.0)
            running = [p for p in pods if p.status.phase == "Running"]
            if len(running) >= len(machines):
                return
            if time.monotonic() > deadline:
                waiting = sorted({p.metadata.name for p in pods} - {p.metadata.name for p in running})
                raise TemporaryError(
                    f"kubernetes: pods of {spec.job} not Running in time: {waiting}", delay=2.0
                )
            time.sleep(self.cfg.poll_s)

    def hot_update(self, spec: JobSpec, version: str, ctx: StepContext) -> None:
        name = _object_name(self.cfg.code_configmap.format(job=spec.job))
        body = {
            "metadata": {
                "name": name,
                "labels": {JOB_LABEL: job_label(spec.job)},
                "annotations": {JOB_NAME: spec.job},
            },
            "data": {"version": version},
        }
        try:
            self._call(
                f"read configmap {name}", ctx, self.core.read_namespaced_config_map, name, self.cfg.namespace
            )
        except PermanentError as exc:
            if "404" not in str(exc):
                raise
            self._call(
                f"create configmap {name} version={version}",
                ctx,
                self.core.create_namespaced_config_map,
                self.cfg.namespace,
                body,
            )
            return
        self._call(
            f"patch configmap {name} version={version}",
            ctx,
            self.core.patch_namespaced_config_map,
            name,
            self.cfg.namespace,
            body,
        )

    def code_version(self, job: str) -> str:
        name = _object_name(self.cfg.code_configmap.format(job=job))
        try:
            cm = self._call(
                f"read configmap {name}", None, self.core.read_namespaced_config_map, name, self.cfg.namespace
            )
        except PermanentError:
            return ""
        return str((cm.data or {}).get("version", ""))

    def run_diagnostics(
        self, spec: JobSpec, machines: list[str], tests: list[str], ctx: StepContext
    ) -> list[DiagnosticResult]:
        unknown = [t for t in tests if t not in self.cfg.diagnostic_commands]
        if unknown:
            raise PermanentError(f"kubernetes: no command for stop-time tests {unknown}")
        runs = [
            (f"tg-diag-{ctx.op_id[:10]}-{_dns(m, 20)}-{_dns(t, 20)}", m, t, self.cfg.diagnostic_commands[t])
            for m in machines
            for t in tests
        ]
        t0 = time.monotonic()
        phases = self._run_tool_pods(
            spec, [(n, [m], argv, DIAG) for n, m, _t, argv in runs], ctx, self.cfg.diagnostics_timeout_s
        )
        ms = (time.monotonic() - t0) * 1000
        return [
            DiagnosticResult(m, t, phases[n][0] == "Succeeded", phases[n][1], duration_ms=ms)
            for n, m, t, _ in runs
        ]

    def run_replay(self, spec: JobSpec, groups: list[list[str]], ctx: StepContext) -> list[bool]:
        if not self.cfg.replay_command:
            raise PermanentError("kubernetes: no replay_command configured")
        runs = [
            (f"tg-replay-{ctx.op_id[:10]}-{i}", g, self.cfg.replay_command, REPLAY)
            for i, g in enumerate(groups)
        ]
        phases = self._run_tool_pods(spec, runs, ctx, self.cfg.replay_timeout_s)
        return [phases[name][0] == "Succeeded" for name, *_ in runs]

    def close(self) -> None:
        with self._lock:
            if self._api is not None:
                self._api.close()
                self._api = None

    # -- helpers -------------------------------------------------------------------------------
    def _free_nodes(self, ctx: StepContext | None) -> list[str]:
        """Ready, schedulable, untainted nodes matching the selector with no TrainGuard job's pod."""
        busy_pods = self._call(
            "list pods of TrainGuard jobs",
            ctx,
            self.core.list_namespaced_pod,
            self.cfg.namespace,
            label_selector=f"{ROLE_LABEL} in ({TRAIN},{STANDBY})",
        ).items
        busy = {p.spec.node_name for p in busy_pods} | {
            (p.spec.node_selector or {}).get(HOSTNAME) for p in busy_pods
        }
        want = self.cfg.standby_node_selector
        free = []
        for node in self.nodes(ctx):
            labels = node.metadata.labels or {}
            if any(labels.get(k) != v for k, v in want.items()):
                continue
            if node.metadata.name in busy or self.usable(node):
                continue
            free.append(node.metadata.name)
        return sorted(free, key=_natural)

    def _generation(self, job: str, ctx: StepContext) -> int:
        """How many restarts the executor has made for ``job`` (persisted: a pod's TRAINGUARD_RESTART)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / f"{_object_name(job, 200)}.restarts"
        seen = path.read_text().split() if path.exists() else []
        if ctx.op_id not in seen:
            seen.append(ctx.op_id)
            path.write_text("\n".join(seen) + "\n")
        return seen.index(ctx.op_id) + 1

    def _labels(
        self, job: str, role: str, ctx: StepContext, extra: dict[str, str] | None = None
    ) -> dict[str, str]:
        return {JOB_LABEL: job_label(job), ROLE_LABEL: role, OP_LABEL: ctx.op_id, **(extra or {})}

    def _base_pod(
        self, template: dict[str, Any], name: str, labels: dict[str, str], job: str
    ) -> dict[str, Any]:
        pod = copy.deepcopy(template)
        pod["apiVersion"], pod["kind"] = "v1", "Pod"
        meta = pod.setdefault("metadata", {})
        meta.pop("generateName", None)
        meta["name"], meta["namespace"] = name, self.cfg.namespace
        meta["labels"] = {**(meta.get("labels") or {}), **labels}
        meta["annotations"] = {**(meta.get("annotations") or {}), JOB_NAME: job}
        spec = pod.setdefault("spec", {})
        spec["restartPolicy"] = "Never"
        if not spec.get("containers"):
            raise PermanentError("kubernetes: the pod template has no containers")
        return pod

    def _train_pod(
        self, spec: JobSpec, index: int, node: str, generation: int, ctx: StepContext
    ) -> dict[str, Any]:
        name = f"{_dns(spec.job, 40)}-{index}-{ctx.op_id[:8]}"
        pod = self._base_pod(
            self.cfg.pod_template,
            name,
            self._labels(spec.job, TRAIN, ctx, {INDEX_LABEL: str(index)}),
            spec.job,
        )
        ps: dict[str, Any] = pod["spec"]
        ps["nodeSelector"] = {**(ps.get("nodeSelector") or {}), HOSTNAME: node}
        ps.setdefault("priorityClassName", self.cfg.training_priority_class)
        ps["terminationGracePeriodSeconds"] = self.cfg.grace_period_s
        cm = _object_name(self.cfg.code_configmap.format(job=spec.job))
        env: list[dict[str, Any]] = [
            {"name": "TRAINGUARD_JOB", "value": spec.job},
            {"name": "TRAINGUARD_MACHINE_INDEX", "value": str(index)},
            {"name": "TRAINGUARD_MACHINES", "value": ",".join(spec.topology.machines)},
            {"name": "TRAINGUARD_RANKS_PER_MACHINE", "value": str(spec.topology.ranks_per_machine)},
            {"name": "TRAINGUARD_RESTART", "value": str(generation)},
            {"name": "TRAINGUARD_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {
                "name": "TRAINGUARD_CODE_VERSION",
                "valueFrom": {"configMapKeyRef": {"name": cm, "key": "version", "optional": True}},
            },
        ]
        for c in ps["containers"]:
            names = {e["name"] for e in env}
            c["env"] = [e for e in (c.get("env") or []) if e.get("name") not in names] + env
        return pod

    def _standby_pod(self, job: str, node: str, ctx: StepContext) -> dict[str, Any]:
        template = self.cfg.standby_template or self.cfg.pod_template
        if not template:
            raise PermanentError("kubernetes: no standby_template or pod_template configured")
        name = f"{_dns(job, 40)}-standby-{_dns(node, 12)}-{ctx.op_id[:6]}"
        pod = self._base_pod(template, name, self._labels(job, STANDBY, ctx), job)
        ps = pod["spec"]
        if not self.cfg.standby_template:
            container = {**ps["containers"][0], "command": list(self.cfg.standby_command), "args": []}
            container.pop("readinessProbe", None)
            if self.cfg.standby_readiness_probe:
                container["readinessProbe"] = copy.deepcopy(self.cfg.standby_readiness_probe)
            ps["containers"] = [container]
        ps["nodeSelector"] = {**(ps.get("nodeSelector") or {}), HOSTNAME: node}
        ps["priorityClassName"] = self.cfg.standby_priority_class
        ps["terminationGracePeriodSeconds"] = 0
        for c in ps["containers"]:
            c["env"] = [e for e in (c.get("env") or []) if e.get("name") != "TRAINGUARD_JOB"] + [
                {"name": "TRAINGUARD_JOB", "value": job},
                {"name": "TRAINGUARD_STANDBY", "value": "1"},
                {"name": "TRAINGUARD_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            ]
        return pod

    def _tool_pod(
        self, spec: JobSpec, name: str, nodes: list[str], argv: list[str], role: str, ctx: StepContext
    ) -> dict[str, Any]:
        template: dict[str, Any] = self.cfg.pod_template or {
            "spec": {"containers": [{"name": "main", "image": self.cfg.tools_image}]}
        }
        pod = self._base_pod(template, name, self._labels(spec.job, role, ctx), spec.job)
        ps = pod["spec"]
        first = dict(ps["containers"][0])
        first.update(command=list(argv), args=[])
        if self.cfg.tools_image:
            first["image"] = self.cfg.tools_image
        first["env"] = [e for e in (first.get("env") or []) if e.get("name") != "TRAINGUARD_MACHINES"] + [
            {"name": "TRAINGUARD_JOB", "value": spec.job},
            {"name": "TRAINGUARD_MACHINES", "value": ",".join(nodes)},
            {"name": "TRAINGUARD_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        ]
        ps["containers"] = [first]
        # nodeName: past the scheduler, so a cordoned (evicted) node still runs its tests.
        ps.pop("nodeSelector", None)
        ps["nodeName"] = nodes[0]
        ps["priorityClassName"] = self.cfg.training_priority_class
        ps["tolerations"] = [*(ps.get("tolerations") or []), {"key": EVICT_TAINT, "operator": "Exists"}]
        return pod

    def _run_tool_pods(
        self,
        spec: JobSpec,
        runs: list[tuple[str, list[str], list[str], str]],
        ctx: StepContext,
        timeout_s: float,
    ) -> dict[str, tuple[str, str]]:
        """Run one pod per (name, nodes, argv, role); returns name -> (phase, detail)."""
        existing = {p.metadata.name: p for p in self.pods(spec.job, None, ctx)}
        for name, nodes, argv, role in runs:
            if name not in existing:
                self._create_pod(self._tool_pod(spec, name, nodes, argv, role, ctx), ctx)
        deadline = time.monotonic() + min(timeout_s, ctx.remaining())
        names = {r[0] for r in runs}
        while True:
            pods = {p.metadata.name: p for p in self.pods(spec.job, None, ctx) if p.metadata.name in names}
            done = {n: p for n, p in pods.items() if p.status.phase in ("Succeeded", "Failed")}
            if len(done) == len(names):
                out = {n: (p.status.phase, _terminated(p)) for n, p in done.items()}
                self._delete_pods(list(done.values()), ctx, grace=0)
                return out
            if time.monotonic() > deadline:
                late = sorted(names - set(done))
                raise TemporaryError(
                    f"kubernetes: {late} of {spec.job} did not finish in {timeout_s:.0f}s", delay=2.0
                )
            time.sleep(self.cfg.poll_s)

    def _create_pod(self, body: dict[str, Any], ctx: StepContext) -> None:
        meta = body["metadata"]
        node = (body["spec"].get("nodeSelector") or {}).get(HOSTNAME) or body["spec"].get("nodeName", "")
        try:
            self._call(
                f"create pod {meta['name']} on {node}",
                ctx,
                self.core.create_namespaced_pod,
                self.cfg.namespace,
                body,
            )
        except TemporaryError as exc:
            if "409" in str(exc):  # created by an earlier attempt of this step
                return
            raise

    def _delete_pods(self, pods: Iterable[Any], ctx: StepContext, grace: int | None = None) -> None:
        g = self.cfg.grace_period_s if grace is None else grace
        for p in pods:
            if p.metadata.deletion_timestamp is not None:
                continue
            try:
                self._call(
                    f"delete pod {p.metadata.name} on {p.spec.node_name}",
                    ctx,
                    self.core.delete_namespaced_pod,
                    p.metadata.name,
                    self.cfg.namespace,
                    grace_period_seconds=g,
                )
            except PermanentError as exc:
                if "404" not in str(exc):  # already gone: what we wanted
                    raise

    def _wait_gone(
        self,
        job: str,
        role: str | None,
        nodes: set[str] | None,
        ctx: StepContext,
        timeout_s: float,
        keep_op: str = "",
    ) -> None:
        deadline = time.monotonic() + min(timeout_s, ctx.remaining())
        while True:
            left = [
                p.metadata.name
                for p in self.pods(job, role, ctx)
                if (
                    nodes is None
                    or p.spec.node_name in nodes
                    or (p.spec.node_selector or {}).get(HOSTNAME) in nodes
                )
                and not (keep_op and (p.metadata.labels or {}).get(OP_LABEL) == keep_op)
            ]
            if not left:
                return
            if time.monotonic() > deadline:
                raise TemporaryError(f"kubernetes: pods of {job} still terminating: {left}", delay=2.0)
            time.sleep(self.cfg.poll_s)


#: taints the node lifecycle controller sets while a node's heartbeat is missing.
_HEARTBEAT_TAINTS = {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}


def _transient(node: Any) -> bool:
    """The node is unusable only for want of a heartbeat (not cordoned, no one else's taint)."""
    if node.spec.unschedulable:
        return False
    hard = {t.key for t in (node.spec.taints or []) if t.effect in ("NoSchedule", "NoExecute")}
    return hard <= _HEARTBEAT_TAINTS


def _taint_dict(t: Any) -> dict[str, Any]:
    d = {"key": t.key, "effect": t.effect}
    if t.value:
        d["value"] = t.value
    return d


def _ready(pod: Any) -> bool:
    if pod.metadata.deletion_timestamp is not None or pod.status.phase != "Running":
        return False
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def _env_job(pod: Any) -> str | None:
    """The ``TRAINGUARD_JOB`` the executor set in a pod's first container (every pod it makes
    has it, last in the list): which job an old-style labelled pod belongs to."""
    found = None
    for c in (pod.spec.containers or [])[:1]:
        for e in c.env or []:
            if e.name == "TRAINGUARD_JOB":
                found = e.value
    return found


def _op(obj: Any) -> str | None:
    return (obj.metadata.labels or {}).get(OP_LABEL)


def _exit_code(pod: Any) -> int | None:
    for cs in pod.status.container_statuses or []:
        term = cs.state.terminated if cs.state else None
        if term is not None:
            return int(term.exit_code)
    return None


def _terminated(pod: Any) -> str:
    for cs in pod.status.container_statuses or []:
        term = cs.state.terminated if cs.state else None
        if term is not None:
            return f"exit {term.exit_code}" + (f": {term.message}" if term.message else "")
    return str(pod.status.phase)


def _natural(name: str) -> tuple[str, int]:
    """n2 before n10."""
    m = re.match(r"(.*?)(\d+)$", name)
    return (m.group(1), int(m.group(2))) if m else (name, -1)


def classify(exc: Any, what: str) -> PermanentError | TemporaryError:
    """An API error as the step runner needs it: retry (throttled, conflict, 5xx) or give up."""
    status = int(getattr(exc, "status", 0) or 0)
    reason = str(getattr(exc, "reason", "") or "")
    body = str(getattr(exc, "body", "") or "")
    message = body
    with contextlib.suppress(ValueError, AttributeError):  # the API's Status, when it sent one
        message = json.loads(body).get("message", body)
    text = f"kubernetes: {what}: {status} {reason}: {message}"[:800]
    if status in (401, 403, 404, 422, 400, 405):
        return PermanentError(text)
    return TemporaryError(text, delay=1.0 if status in (409, 429) else 2.0)


PLUGIN = ExecutorPlugin("kubernetes", KubernetesExecutorConfig, KubernetesExecutor)
