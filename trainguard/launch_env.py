"""Slurm's environment -> what one ``trainguard launch`` task does (pure: no I/O, no clock;
:func:`read_positions` alone reads a file, ``topology.conf``, and :func:`find_master` alone asks
the resolver and, when it must, ``scontrol``).

``srun`` starts one ``trainguard launch`` per task and describes the step in the task's
environment.  :func:`plan_launch` turns that environment and the launch options
(:class:`LaunchConfig`) into a :class:`LaunchPlan`: the job topology (TP/PP/DP from the options,
``ranks_per_machine`` = tasks per node, ``machines`` = the step's nodes in Slurm's order), this
task's rank, local rank and node, the rendezvous address, the standbys (nodes of the allocation
outside the step) and the environment the training process gets.

Which Slurm variables are read, first one set wins:

* job id ``SLURM_JOB_ID``; step id ``SLURM_STEP_ID`` (required: set by ``srun`` only);
* rank ``SLURM_PROCID``; local rank ``SLURM_LOCALID``; node ``SLURMD_NODENAME``;
* world size ``SLURM_STEP_NUM_TASKS``, ``SLURM_NTASKS``;
* tasks per node ``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_TASKS_PER_NODE``, ``SLURM_NTASKS_PER_NODE``
  (``2(x3)`` means 2 on each of 3 nodes; different counts per node are refused: TrainGuard's
  topology puts the same number of consecutive ranks on every machine);
* the step's nodes ``SLURM_STEP_NODELIST``, ``SLURM_JOB_NODELIST``, in the order of
  ``TRAINGUARD_NODES`` when the action service started the step (it keeps each rank's place: a
  spare takes the evicted node's ranks); the allocation's ``SLURM_JOB_NODELIST``,
  ``SLURM_NODELIST`` (neither: no standbys).

The rendezvous address (``MASTER_ADDR``) is ``--master-addr`` when given, else rank 0's node: the
first of the step's nodes (``TRAINGUARD_NODES``' first in a restarted step).  :func:`find_master`
uses that node's name when it resolves (``getaddrinfo``), else its ``NodeAddr`` from ``scontrol
show node NAME -o`` -- Slurm's own address of the node, which is what a cluster whose node names
are not in DNS declares in ``slurm.conf`` (the local stack's nodes: ``NodeAddr=127.0.0.1``).  Only
a task whose name lookup fails asks ``scontrol`` (once), so a cluster whose names resolve never
puts one query per rank on ``slurmctld``.

Ranks must be placed in blocks (``srun --distribution=block``, the default): rank ``r`` on node
``r // tasks_per_node``, which is checked against ``SLURMD_NODENAME`` and ``SLURM_LOCALID``.

>>> env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
...        "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURMD_NODENAME": "gpu-02",
...        "SLURM_STEP_NODELIST": "gpu-[01-02]", "SLURM_JOB_NODELIST": "gpu-[01-03]"}
>>> plan = plan_launch(LaunchConfig(job="llm", tp=2), env)
>>> plan.topology.machines, plan.topology.dp, plan.standbys, plan.master_addr, plan.master_port
(['gpu-01', 'gpu-02'], 2, ['gpu-03'], 'gpu-01', 24242)
>>> plan.child_env()["RANK"], plan.child_env()["LOCAL_RANK"], plan.child_env()["TRAINGUARD_NODE"]
('3', '1', 'gpu-02')
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from trainguard.actions.executors.slurm import expand_hostlist
from trainguard.actions.positions import TopologyConfError, parse_topology_conf
from trainguard.schemas import names
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import JobSpec
from trainguard.schemas.limits import JOB
from trainguard.schemas.network import MachinePosition
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.typecheck import bounds
from trainguard.streams.reporter import DEFAULT_SOCKET

#: a derived rendezvous port is ``PORT_BASE + job id % PORT_SPAN``: below Linux's ephemeral range
#: (32768+), so no outgoing connection holds it by chance, and the same for every task of a job.
PORT_BASE, PORT_SPAN = 20_000, 10_000
#: a Slurm node name (what a host list expands to): no brackets, commas or blanks left.
_NODE = re.compile(r"^[A-Za-z0-9_.-]+$")
_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
#: how long one ``scontrol show node`` may take (asked once, before the training starts).
SCONTROL_TIMEOUT_S = 10.0


class LaunchError(ValueError):
    """The environment or the options do not describe a step ``trainguard launch`` can run."""


@dataclass(frozen=True)
class LaunchConfig:
    """The settings of ``trainguard launch`` (its command-line options, one per field).

    Paths may hold ``{job_id}``, ``{step_id}``, ``{node}``, ``{rank}`` and ``{local_rank}``, filled
    in per task (on one host several tasks need several files).
    """

    #: the TrainGuard job name (what the workers, the action service and postmortems call it).
    job: str = field(metadata=JOB)
    #: tensor, pipeline and data parallel sizes; ``dp`` 0: the world size / (tp * pp).
    tp: int = field(default=1, metadata=bounds(1, 1 << 20))
    pp: int = field(default=1, metadata=bounds(1, 1 << 20))
    dp: int = field(default=0, metadata=bounds(0, 1 << 20))
    #: rank order, fastest-varying dimension first (Megatron-LM's ``--order``).
    order: str = field(default="tp-dp-pp", metadata=bounds(max_len=8))
    #: rendezvous host; "" = rank 0's node: its name when it resolves, else its Slurm ``NodeAddr``
    #: (:func:`find_master`).
    master_addr: str = field(default="", metadata=bounds(max_len=255))
    #: rendezvous port; 0 = ``PORT_BASE + job id % PORT_SPAN``, the same on every task.
    master_port: int = field(default=0, metadata=bounds(0, 65535))
    #: the node exporter's reporter socket; "" = ``$TRAINGUARD_REPORTER_SOCKET`` or the reporter's
    #: default (``/run/trainguard/reporter.sock``, the systemd unit's).
    reporter_socket: str = field(default="", metadata=bounds(max_len=4096))
    #: how often the rank is registered with the node exporter again (on that socket): an exporter
    #: started or restarted after the launcher learns the rank within this.  A failed send is
    #: retried sooner (from 0.5 s, doubling up to this).
    register_interval_s: float = field(default=10.0, metadata=bounds(0.5, 3600))
    #: file written (atomically) once this task is ready; "" = none.
    ready_file: str = field(default="", metadata=bounds(max_len=4096))
    #: publish the JobSpec from rank 0 (never from a step the action service restarted: it
    #: published the spec it restarted on, and the latest spec wins).
    publish: bool = True
    #: how long rank 0 keeps trying to publish the spec (training runs meanwhile).
    publish_timeout_s: float = field(default=60.0, metadata=bounds(1, 86_400))
    #: Slurm's ``topology.conf``, for the machines' network positions in the first spec (the
    #: placement planner's input); "" = beside ``$SLURM_CONF`` (default ``/etc/slurm/slurm.conf``).
    #: Absent or unreadable: the spec goes out without positions (said, never fatal).
    topology_conf: str = field(default="", metadata=bounds(max_len=4096))
    #: a node's pod is the switch this many levels above its rack's (the action service's
    #: ``executor_options.topology_pod_level``: both must read the tree the same way).
    topology_pod_level: int = field(default=1, metadata=bounds(1, 16))
    #: run the task as a warm node agent (:mod:`trainguard.agent`) holding its rank, instead of
    #: a plain child: a later restart forks the rank from the agent's zygote, in place.
    agent: bool = False
    #: modules the agent's zygote imports before forking (torch, the model's modules; never CUDA).
    agent_preload: list[str] = field(default_factory=list, metadata=bounds(max_len=256, max_items=1024))
    #: the agent of local rank L serves ``GET /state`` and ``POST /command`` on this port + L
    #: (0: a free port, said in its state file).
    agent_port: int = field(default=9403, metadata=bounds(0, 65535 - 4096))
    #: the agent's state file, dead letters and rank logs (placeholders as above).
    agent_state_dir: str = field(
        default="/run/trainguard/agent/{job_id}/{local_rank}", metadata=bounds(max_len=4096)
    )
    #: code version V lives in ``agent_code_root/V`` ("" = no hot updates).
    agent_code_root: str = field(default="", metadata=bounds(max_len=4096))

    def __post_init__(self) -> None:
        # Checked here too (not only when loaded): the spec this job publishes must decode.
        why = names.JOB.problem(self.job)
        if why is not None:
            raise ValueError(f"job {why}")
        if sorted(self.order.split("-")) != ["dp", "pp", "tp"]:
            raise ValueError(f"order {self.order!r} must be a permutation of tp, dp, pp (e.g. 'tp-dp-pp')")


@dataclass(frozen=True)
class LaunchPlan:
    """What one task of the step does; see the module docstring."""

    job: str
    slurm_job_id: str
    step_id: str
    rank: int
    local_rank: int
    node: str
    topology: JobTopology
    #: nodes of the allocation outside the step (warm standbys for the action service).
    standbys: list[str]
    master_addr: str
    master_port: int
    reporter_socket: str
    ready_file: str
    #: ``TRAINGUARD_RESTART`` of a step the action service (re)started; 0 for the job's own launch.
    restart: int
    publish: bool
    #: network positions of the step's nodes and standbys (``read_positions``), for the spec.
    positions: dict[str, MachinePosition] = field(default_factory=dict)
    #: how ``master_addr`` was found (:func:`find_master`); "" before it ran.
    master_from: str = ""

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def publishes(self) -> bool:
        """Whether this task publishes the job's spec: rank 0 of a step the job script started."""
        return self.publish and self.rank == 0 and self.restart == 0

    def child_env(self) -> dict[str, str]:
        """The variables the training process gets on top of the launcher's environment."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.topology.ranks_per_machine),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "TRAINGUARD_JOB": self.job,
            "TRAINGUARD_RANK": str(self.rank),
            "TRAINGUARD_NODE": self.node,
            # every rank's node in rank order (node i holds ranks [i*LOCAL_WORLD_SIZE, ...)).
            "TRAINGUARD_MACHINES": ",".join(self.topology.machines),
            "TRAINGUARD_REPORTER_SOCKET": self.reporter_socket,
        }

    def job_spec(self, ts_ms: int | None = None) -> JobSpec:
        return JobSpec(
            job=self.job,
            ts_ms=now_ms() if ts_ms is None else ts_ms,
            topology=self.topology,
            standbys=list(self.standbys),
            positions=dict(self.positions),
        )


def topology_conf_path(cfg: LaunchConfig, environ: Mapping[str, str]) -> str:
    """Where ``topology.conf`` is: the option, else beside ``$SLURM_CONF`` (Slurm's own rule)."""
    if cfg.topology_conf:
        return cfg.topology_conf
    slurm_conf = environ.get("SLURM_CONF", "").strip() or "/etc/slurm/slurm.conf"
    return os.path.join(os.path.dirname(slurm_conf), "topology.conf")


def read_positions(plan: LaunchPlan, cfg: LaunchConfig, environ: Mapping[str, str]) -> tuple[LaunchPlan, str]:
    """``plan`` with the positions of its nodes and standbys from ``topology.conf``, and what to
    say about it ("" when there is nothing to say).  The file's absence or a line Slurm itself
    would refuse leaves the plan without positions: the job runs either way, and the action
    service still reads the file from its side."""
    path = topology_conf_path(cfg, environ)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return plan, ""
    except OSError as exc:
        return plan, f"{path}: {exc.strerror or exc}; the job spec goes out without network positions"
    try:
        found = parse_topology_conf(text, cfg.topology_pod_level)
    except TopologyConfError as exc:
        return plan, f"{path}: {exc}; the job spec goes out without network positions"
    wanted = [*plan.topology.machines, *plan.standbys]
    positions = {m: found[m] for m in wanted if m in found}
    missing = [m for m in wanted if m not in found]
    note = f"network positions of {len(positions)} node(s) from {path}"
    if missing:
        note += f"; not listed there: {','.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
    return replace(plan, positions=positions), note


def node_addr(line: str) -> str:
    """The ``NodeAddr`` of a ``scontrol show node NAME -o`` line; "" when it has none.

    >>> node_addr("NodeName=n1 Arch=x86_64 CoresPerSocket=1  NodeAddr=127.0.0.1 NodeHostName=localhost")
    '127.0.0.1'
    >>> node_addr("NodeName=n1 NodeAddr=(null)"), node_addr("Node n9 not found")
    ('', '')
    """
    for part in line.split():
        key, sep, value = part.partition("=")
        if sep and key == "NodeAddr" and value not in ("", "(null)"):
            return value
    return ""


def name_resolves(name: str) -> bool:
    """Whether ``name`` resolves on this host (the system's resolver: files, DNS, ...)."""
    try:
        socket.getaddrinfo(name, None)
    except (OSError, UnicodeError):  # gaierror is an OSError; an over-long label a UnicodeError
        return False
    return True


def scontrol_show_node(name: str, environ: Mapping[str, str]) -> str:
    """``scontrol show node NAME -o`` (its output, or why there is none, prefixed ``error:``)."""
    try:
        res = subprocess.run(
            ["scontrol", "show", "node", name, "-o"],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
            env=dict(environ),
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        return "error: scontrol is not installed"
    except subprocess.TimeoutExpired:
        return f"error: scontrol did not answer in {SCONTROL_TIMEOUT_S:.0f} s"
    if res.returncode != 0:
        return f"error: {(res.stderr or res.stdout).strip()[-200:] or f'scontrol exited {res.returncode}'}"
    return res.stdout


def find_master(
    plan: LaunchPlan,
    cfg: LaunchConfig,
    environ: Mapping[str, str],
    resolves: Callable[[str], bool] = name_resolves,
    show_node: Callable[[str, Mapping[str, str]], str] = scontrol_show_node,
) -> LaunchPlan:
    """``plan`` with its rendezvous address and how it was found (``master_from``): see the module
    docstring.  A node whose name does not resolve and that Slurm gives no other address keeps its
    name, said in ``master_from`` (starting ``unresolved``): the rendezvous will fail, and
    ``--master-addr`` is the fix.

    >>> env = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
    ...        "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NODELIST": "n[1-2]"}
    >>> cfg = LaunchConfig(job="llm")
    >>> plan = plan_launch(cfg, env)
    >>> show = lambda name, environ: f"NodeName={name} NodeAddr=10.1.0.{name[1:]} NodeHostName={name}"
    >>> p = find_master(plan, cfg, env, resolves=lambda name: False, show_node=show)
    >>> p.master_addr, p.master_from
    ('10.1.0.1', 'NodeAddr of n1 (scontrol show node; the name n1 does not resolve here)')
    >>> find_master(plan, cfg, env, resolves=lambda name: True, show_node=show).master_from
    "rank 0's node n1 (its name resolves)"
    """
    if cfg.master_addr:
        return replace(plan, master_addr=cfg.master_addr, master_from="--master-addr")
    first = plan.topology.machines[0]
    if resolves(first):
        return replace(plan, master_addr=first, master_from=f"rank 0's node {first} (its name resolves)")
    answer = show_node(first, environ)
    addr = next((a for a in map(node_addr, answer.splitlines()) if a), "")
    if addr and addr != first:
        how = f"NodeAddr of {first} (scontrol show node; the name {first} does not resolve here)"
        return replace(plan, master_addr=addr, master_from=how)
    why = answer.strip()[:200] if answer.startswith("error:") else "Slurm gives it no other NodeAddr"
    how = f"unresolved: rank 0's node {first} does not resolve here and {why}; pass --master-addr"
    return replace(plan, master_addr=first, master_from=how)


def parse_tasks_per_node(text: str) -> list[int]:
    """Slurm's tasks-per-node list, one count per node.

    >>> parse_tasks_per_node("2(x3),1"), parse_tasks_per_node("8")
    ([2, 2, 2, 1], [8])
    """
    out: list[int] = []
    for part in text.strip().split(","):
        m = _TASKS.match(part.strip())
        if m is None:
            raise LaunchError(
                f"tasks per node {text!r} is not a Slurm task count list (like '8' or '2(x3),1')"
            )
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def derived_port(slurm_job_id: str) -> int:
    """The rendezvous port of a job: the same on every task, different for neighbouring job ids.

    >>> derived_port("4242"), derived_port("1234567")
    (24242, 24567)
    """
    number = int(slurm_job_id) if slurm_job_id.isdigit() else zlib.crc32(slurm_job_id.encode())
    return PORT_BASE + number % PORT_SPAN


def plan_launch(cfg: LaunchConfig, environ: Mapping[str, str]) -> LaunchPlan:
    """The plan of the task whose environment is ``environ``; :class:`LaunchError` says what is wrong."""
    job_id = _required(environ, "SLURM_JOB_ID")
    step_id = environ.get("SLURM_STEP_ID", "").strip()
    if not step_id:
        raise LaunchError(
            "SLURM_STEP_ID is not set: run `trainguard launch` as a job step, under srun "
            "(`srun ... trainguard launch --job J -- CMD`), not in the batch script itself"
        )
    rank = _int(environ, "SLURM_PROCID")
    world = _int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    step_var, step_list = _first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
    machines = _hosts(step_var, step_list)
    ordered = environ.get("TRAINGUARD_NODES", "").strip()
    if ordered:
        # A step the action service started: its node order (a spare in the evicted node's
        # place, ranks placed in that order by ``srun --distribution=arbitrary``), not Slurm's.
        order = _hosts("TRAINGUARD_NODES", ordered)
        if sorted(order) != sorted(machines):
            raise LaunchError(
                f"TRAINGUARD_NODES={ordered} names other nodes than the step's {step_var}={step_list}"
            )
        machines, step_var, step_list = order, "TRAINGUARD_NODES", ordered
    try:
        alloc_var, alloc_list = _first(environ, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    except LaunchError:  # no allocation list: no standbys
        alloc_var, alloc_list = step_var, step_list
    allocation = _hosts(alloc_var, alloc_list)
    tpn_var, tpn_text = _first(
        environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"
    )
    counts = parse_tasks_per_node(tpn_text)
    if len(set(counts)) != 1:
        raise LaunchError(
            f"{tpn_var}={tpn_text}: the step has different task counts per node; TrainGuard needs the "
            "same number of ranks on every node (srun --ntasks-per-node=N)"
        )
    tpn = counts[0]
    if tpn < 1:
        raise LaunchError(f"{tpn_var}={tpn_text}: no tasks per node")
    if len(counts) > 1 and len(counts) != len(machines):
        raise LaunchError(
            f"{tpn_var}={tpn_text} counts {len(counts)} nodes, {step_var} lists {len(machines)}"
        )
    if world != tpn * len(machines):
        raise LaunchError(
            f"the step has {world} tasks but {len(machines)} node(s) x {tpn} task(s) per node "
            f"= {tpn * len(machines)} ({step_var}={step_list}, {tpn_var}={tpn_text})"
        )
    if not 0 <= rank < world:
        raise LaunchError(f"SLURM_PROCID={rank} is outside the step's {world} tasks")
    parallel = cfg.tp * cfg.pp
    dp = cfg.dp or world // parallel
    if parallel * dp != world:
        given = f"dp {cfg.dp}" if cfg.dp else f"no dp divides {world} tasks by tp*pp = {parallel}"
        raise LaunchError(
            f"tp {cfg.tp} x pp {cfg.pp} x {given}: the topology needs tp*pp*dp = {world} ranks, "
            f"one per Slurm task"
        )
    expected = machines[rank // tpn]
    node = environ.get("SLURMD_NODENAME", "").strip() or expected
    if node != expected:
        raise LaunchError(
            f"rank {rank} runs on {node} but block placement puts it on {expected}: TrainGuard needs "
            "consecutive ranks per node (srun --distribution=block, the default)"
        )
    local_rank = _int(environ, "SLURM_LOCALID") if environ.get("SLURM_LOCALID", "").strip() else rank % tpn
    if local_rank != rank % tpn:
        raise LaunchError(
            f"SLURM_LOCALID={local_rank} of rank {rank}: block placement with {tpn} task(s) per node "
            f"gives {rank % tpn} (srun --distribution=block, the default)"
        )
    try:
        topology = JobTopology(
            job=cfg.job,
            tp=cfg.tp,
            pp=cfg.pp,
            dp=dp,
            ranks_per_machine=tpn,
            order=cfg.order,
            machines=machines,
        )
    except ValueError as exc:
        raise LaunchError(f"job topology: {exc}") from None
    restart_text = environ.get("TRAINGUARD_RESTART", "").strip() or "0"
    if not restart_text.isdigit():
        raise LaunchError(f"TRAINGUARD_RESTART={restart_text!r} is not a number")
    fill = {"job_id": job_id, "step_id": step_id, "node": node, "rank": rank, "local_rank": local_rank}
    socket = cfg.reporter_socket or environ.get("TRAINGUARD_REPORTER_SOCKET", "") or DEFAULT_SOCKET
    return LaunchPlan(
        job=cfg.job,
        slurm_job_id=job_id,
        step_id=step_id,
        rank=rank,
        local_rank=local_rank,
        node=node,
        topology=topology,
        standbys=[n for n in allocation if n not in machines],
        master_addr=cfg.master_addr or machines[0],
        master_port=cfg.master_port or derived_port(job_id),
        reporter_socket=fill_path("reporter socket", socket, fill),
        ready_file=fill_path("--ready-file", cfg.ready_file, fill),
        restart=int(restart_text),
        publish=cfg.publish,
    )


def _first(environ: Mapping[str, str], *names: str) -> tuple[str, str]:
    """(name, value) of the first of ``names`` set to a non-empty value."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    raise LaunchError(f"{' / '.join(names)} not set: is this a Slurm step (run under srun)?")


def _required(environ: Mapping[str, str], name: str) -> str:
    return _first(environ, name)[1]


def _int(environ: Mapping[str, str], *names: str) -> int:
    name, value = _first(environ, *names)
    if not value.isdigit():
        raise LaunchError(f"{name}={value!r} is not a non-negative integer")
    return int(value)


def _hosts(var: str, text: str) -> list[str]:
    try:
        names = expand_hostlist(text)
    except ValueError:
        names = []
    bad = [n for n in names if not _NODE.match(n)]
    if not names or bad:
        raise LaunchError(f"{var}={text!r} is not a Slurm host list (like 'n[1-4]' or 'gpu-[01-03,07]')")
    if len(set(names)) != len(names):
        raise LaunchError(f"{var}={text!r} names a node twice")
    return names


def fill_path(what: str, template: str, values: Mapping[str, object]) -> str:
    try:
        return template.format(**values)
    except (KeyError, IndexError, ValueError) as exc:
        raise LaunchError(
            f"{what} {template!r}: bad placeholder ({exc}); use {{job_id}}, {{step_id}}, {{node}}, "
            "{rank} or {local_rank}"
        ) from None
