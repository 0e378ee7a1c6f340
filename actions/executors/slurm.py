"""The Slurm executor: recovery steps on a Slurm cluster, through Slurm's own CLI.

**Model.**  A training job is *one* Slurm allocation (normally an ``sbatch`` job) holding the job's
active nodes plus spare nodes (warm standbys); the ranks run as one job step on the active nodes.
Recovery therefore never waits in the queue:

* ``stop`` cancels the training step(s) (``scancel <job>.<step>``) and keeps the allocation;
* ``evict`` drains the nodes (``scontrol update NodeName=X State=DRAIN Reason="trainguard <decision
  id>: ..."``) -- only nodes of the job's allocation, never anybody else's;
* ``activate_standbys`` checks the spares (in the allocation, not drained, ``srun true`` works);
  ``restart`` then starts a new step (``srun --jobid``) on the spec's nodes, detached, and returns
  once Slurm lists it; the ranks resume from their own latest checkpoint;
* ``provision_standbys`` hands out an unused node of the allocation when there is one, else grows
  the allocation (a standby job with ``--dependency=expand:<job>`` merged into it -- needs
  ``SchedulerParameters=permit_job_expansion``), else -- only while no training step runs, i.e.
  within a recovery, never to refill the pool of a running job -- requeues the job with the bad
  nodes excluded and the healthy ones required (``scontrol requeuehold`` + ``update`` +
  ``release``); the path taken is logged and kept in :attr:`SlurmExecutor.last_provision`;
* ``run_diagnostics`` / ``run_replay`` run the configured commands as steps on the named nodes;
* ``hot_update`` switches the code version (``hot_update_command``, then ``version_file``); the
  plan's next step restarts the job, whose ranks get it as ``TRAINGUARD_CODE_VERSION``.
* with ``agents`` (the ranks under ``trainguard launch --agent``), ``stop``, ``restart`` and
  ``hot_update`` go through the job's warm node agents when every one is warm -- the ranks restart
  in place, in the same step -- and take the cold path above otherwise
  (:mod:`trainguard.actions.executors.slurm_warm`);
* ``machine_positions`` reads each node's leaf switch and spine from ``topology.conf``, for the
  action service's topology-aware choice of standbys (:mod:`trainguard.actions.placement`).

The training step's ``srun`` runs on the action service's host (its own session, output in
``<state dir>/slurm/<job>/step-<n>.log``), so that host must be a Slurm submit host; the step
outlives a restart of the service, not a reboot of its host.

**Why the CLI** (``squeue``, ``scontrol -o``, ``srun``, ``scancel``, ``salloc``) and not
``slurmrestd``: every Slurm site has the CLI and a ``slurm.conf`` (``SLURM_CONF``), whereas
slurmrestd is an optional daemon with its own JWT/auth set-up and an API version that changes with
every release; the one-line outputs (``-o`` / ``-h``) are stable enough to parse, and every command
is the one an operator would type -- which is what the command log shows them.

**Runs of one name.**  A TrainGuard job name may be reused by a later Slurm job (a new ``sbatch``
of the same script).  The executor's state (``<state dir>/slurm/<job>.json``) keeps the nodes it
handed out per Slurm job id, so a new run's spares are not taken for the old run's; what is keyed
by op id (a step's provisioned nodes, a requeue under way) belongs to one run anyway.  Of several
queued jobs with the job's name (``squeue -n``, with ``-u user`` when ``user`` is set), the one
running is taken; two running need ``user`` or ``job_ids``.

Every command's argv, exit code, duration and output tail is kept (the last ``history`` in
:attr:`SlurmExecutor.commands`, all of them in ``<state dir>/slurm/commands.jsonl`` with the step's
``op_id``) and the failing command is quoted in every error, so the action events say what Slurm
answered.  Slurm unreachable or a command timing out raises :class:`TemporaryError`; an unknown
job, step or node, or a node outside the job, :class:`PermanentError`.

**What a real site changes**: ``slurm_conf`` (or ``SLURM_CONF`` in the service's environment), a
user the action service runs as that may drain nodes (Slurm operator: ``sacctmgr modify user ...
set adminlevel=operator``) and launch steps in the users' jobs (root/SlurmUser, or the service runs
as the job's user), ``step_command`` (the job's own launcher, e.g. ``trainguard launch --job J --
python train.py``), ``tasks_per_node`` (GPUs per node), ``srun_args`` (``--gpus-per-node``,
``--output`` on a shared file system), diagnostics that test GPUs (``dcgmi diag -r 1``,
``nvidia-smi``), ``permit_job_expansion`` for the grow path and a reservation for the requeue path
(otherwise other jobs may take the freed nodes while the job is requeued).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import subprocess
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from trainguard.actions.errors import PermanentError, TemporaryError
from trainguard.actions.executors.base import (
    DiagnosticResult,
    ExecutorEnv,
    ExecutorPlugin,
    StepContext,
    unconfigured_commands,
)
from trainguard.actions.executors.hostlist import expand_hostlist
from trainguard.actions.executors.slurm_warm import SlurmWarmPath
from trainguard.actions.positions import parse_topology_conf
from trainguard.schemas import names
from trainguard.schemas.control import JobSpec
from trainguard.schemas.network import MachinePosition
from trainguard.schemas.typecheck import bounds

log = logging.getLogger(__name__)

_SECONDS = bounds(0.1, 86_400)

#: step-name prefixes of this executor's own steps; anything else numeric is a training step.
TRAIN, DIAG, REPLAY, CHECK = "tg-train", "tg-diag", "tg-replay", "tg-check"
_OWN = (DIAG, REPLAY, CHECK)
#: runs (Slurm jobs) of one TrainGuard job whose handed-out nodes the state file keeps; a job name
#: reused for the ninth time forgets the first run's.
RUNS_KEPT = 8
#: Slurm job states in which the allocation is coming (retry later) rather than gone.
_COMING = {"PENDING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING"}
#: node state flags that make a node unusable for the job.
_BAD_FLAGS = {"DRAIN", "DRAINED", "DRAINING", "DOWN", "FAIL", "FAILING", "NOT_RESPONDING", "MAINT"}
#: error texts of Slurm commands that no retry can fix.
_PERMANENT = (
    "invalid job id",
    "invalid node name",
    "invalid job step",
    "not found",
    "access/permission denied",
    "permission denied",
    "only batch jobs",
    "invalid partition",
    "requested node configuration is not available",
)


@dataclass(frozen=True)
class SlurmExecutorConfig:
    """Settings of the Slurm executor (``actions.executor_options`` when ``executor: slurm``)."""

    #: the cluster's slurm.conf; empty: ``SLURM_CONF`` of the service's environment (or Slurm's default).
    slurm_conf: str = ""
    #: TrainGuard job -> Slurm job id, for jobs not found by name.
    job_ids: dict[str, int] = field(default_factory=dict)
    #: the Slurm job name of a TrainGuard job (``{job}`` is replaced); found with ``squeue -n``.
    job_name: str = "{job}"
    #: only jobs of this Slurm user (empty: any user).
    user: str = ""
    #: partition for standby allocations; empty: the job's own.
    partition: str = ""
    #: the training step's command (argv) run by every rank; required for ``restart``.
    step_command: list[str] = field(default_factory=list)
    #: tasks (ranks) per node of the training step; 0: the topology's ``ranks_per_machine``.
    tasks_per_node: int = field(default=0, metadata=bounds(0, 4096))
    #: extra ``srun`` options of the training step (``--gpus-per-node=8``, ``--output=...``; in
    #: ``--output``/``--error`` patterns ``%x`` is the Slurm job's name, as in the job's own steps).
    srun_args: list[str] = field(default_factory=list)
    #: steps ``stop`` leaves running (by name: a per-job exporter started with ``srun --overlap``).
    keep_steps: list[str] = field(default_factory=lambda: ["tg-exporter"])
    #: stop-time test name -> command (argv) run on each node as a step; exit 0 = passed.
    diagnostic_commands: dict[str, list[str]] = field(default_factory=lambda: {"launch": ["true"]})
    #: replay command (argv) run on each replay group as a step; empty: the escalation ladder
    #: skips dual-phase replay (the job is restarted instead).
    replay_command: list[str] = field(default_factory=list)
    #: file holding the job's code version (``{job}`` replaced; read by the ranks' launcher);
    #: empty: ``<state dir>/slurm/<job>/code_version``.
    version_file: str = ""
    #: command (argv) that switches the job's code (``{job}``/``{version}`` replaced), e.g.
    #: ``git -C /shared/code/{job} checkout {version}``; must be idempotent.  Empty: the file only.
    hot_update_command: list[str] = field(default_factory=list)
    #: run ``srun true`` on standbys before activating them.
    check_standbys: bool = True
    #: grow the allocation with a standby job when its spares run out (permit_job_expansion).
    allow_expand: bool = True
    #: requeue the job with the bad nodes excluded when nothing else gives nodes.
    allow_requeue: bool = True
    #: timeout of one query/update command (squeue, scontrol, scancel).
    command_timeout_s: float = field(default=15.0, metadata=_SECONDS)
    #: how long a new training step may take to appear in Slurm.
    launch_timeout_s: float = field(default=30.0, metadata=_SECONDS)
    #: how long cancelled steps may take to leave.
    stop_timeout_s: float = field(default=30.0, metadata=_SECONDS)
    diagnostics_timeout_s: float = field(default=60.0, metadata=_SECONDS)
    replay_timeout_s: float = field(default=600.0, metadata=_SECONDS)
    #: how long a standby allocation or a requeued job may take to start.
    provision_timeout_s: float = field(default=60.0, metadata=_SECONDS)
    #: commands kept in memory (:attr:`SlurmExecutor.commands`).
    history: int = field(default=50, metadata=bounds(1, 10_000))
    #: the cluster's topology.conf (``topology/tree``), where machine positions are read for
    #: topology-aware swaps; empty: ``topology.conf`` beside the slurm.conf, when there is one.
    topology_conf: str = ""
    #: a machine's pod is its leaf switch's ancestor this many levels up (1: the spine).
    topology_pod_level: int = field(default=1, metadata=bounds(0, 16))
    #: the ranks run under warm node agents (``trainguard launch --agent``, docs/guides/warm-agent.md):
    #: ``stop``, ``restart`` (a swap's too) and ``hot_update`` go through them when every agent of
    #: the old and new node lists is warm, else the cold path (scancel, a new step).  Needs signing.
    agents: bool = False
    #: a node's first agent port (the agent's ``--port`` / ``launch --agent-port``).
    agent_port: int = field(default=9403, metadata=bounds(1, 65535))
    #: node -> its own first agent port, where several slurmd share one address (the local stack:
    #: every node is 127.0.0.1) and their agents therefore distinct ports.
    agent_ports: dict[str, int] = field(default_factory=dict)
    #: one agent per rank at ``agent_port`` + local rank (``launch --agent``); off: one agent per
    #: node (``trainguard agent --ranks-per-node N``) at ``agent_port``.
    agent_per_rank: bool = True
    #: an agent's answer to a state query or a command (a restart waits for its ranks' stop+fork).
    agent_timeout_s: float = field(default=30.0, metadata=_SECONDS)
    #: the warm path's ``MASTER_PORT``s: generation g gets ``lo + g % (hi - lo)``.
    agent_master_ports: list[int] = field(default_factory=lambda: [29600, 29900], metadata=bounds(1, 65535))

    def __post_init__(self) -> None:
        ports = self.agent_master_ports
        if len(ports) != 2 or not ports[0] < ports[1]:
            raise ValueError(f"agent_master_ports: give [lo, hi] with lo < hi, got {self.agent_master_ports}")


@dataclass(frozen=True)
class CommandRecord:
    """One Slurm command the executor ran."""

    argv: list[str]
    rc: int | None  # None: launched detached, or killed at its timeout
    seconds: float
    stdout: str = ""  # tails
    stderr: str = ""
    op_id: str = ""
    #: the whole stdout, for parsing (not kept in the history or the log).
    output: str = field(default="", repr=False, compare=False)

    def summary(self) -> str:
        out = (self.stderr or self.stdout).strip()
        tail = f": {out[-400:]}" if out else ""
        return f"`{shlex.join(self.argv)}` -> {self.rc} ({self.seconds:.2f} s){tail}"


@dataclass(frozen=True)
class SlurmJob:
    """The parts of ``scontrol -o show job`` the executor uses."""

    job_id: str
    state: str
    nodes: list[str]
    batch: bool
    partition: str
    restarts: int
    fields: dict[str, str]


@dataclass(frozen=True)
class SlurmStep:
    step_id: str  # "<job>.<n>", "<job>.batch"
    name: str
    nodes: list[str]

    @property
    def numeric(self) -> bool:
        return self.step_id.rpartition(".")[2].isdigit()


# -- parsing ------------------------------------------------------------------------------------
_KEY = re.compile(r"\s+(?=[A-Za-z][\w:/.+-]*=)")


def parse_record(line: str) -> dict[str, str]:
    """One ``scontrol -o`` line as a dict (values may hold spaces, e.g. ``Reason``).

    >>> r = parse_record("NodeName=n3 State=IDLE+DRAIN Reason=trainguard d1: evict [root@x] Port=1")
    >>> r["State"], r["Reason"], r["Port"]
    ('IDLE+DRAIN', 'trainguard d1: evict [root@x]', '1')
    """
    out: dict[str, str] = {}
    for part in _KEY.split(line.strip()):
        key, sep, value = part.partition("=")
        if sep:
            out[key] = value.strip()
    return out


def node_flags(state: str) -> set[str]:
    """``MIXED+DRAIN`` / ``IDLE*`` -> {MIXED, DRAIN} / {IDLE, NOT_RESPONDING}."""
    flags = set()
    for part in state.upper().split("+"):
        if part.endswith("*"):
            flags.add("NOT_RESPONDING")
            part = part.rstrip("*")
        flags.add(part)
    return flags


class SlurmExecutor:
    """Recovery steps on a Slurm cluster; see the module docstring."""

    name = "slurm"

    def __init__(self, cfg: SlurmExecutorConfig, env: ExecutorEnv) -> None:
        self.cfg = cfg
        self.diagnostic_tests = tuple(cfg.diagnostic_commands)
        self.dir = env.state_dir / "slurm"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.commands: deque[CommandRecord] = deque(maxlen=cfg.history)
        #: how the last provision_standbys got its nodes (``spare`` / ``expand`` / ``requeue``).
        self.last_provision: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._launched: dict[str, subprocess.Popen[bytes]] = {}
        #: signs the node agents' commands (the action service's ``actions`` key).
        self.signer = env.signer
        #: stop / restart / hot update through the node agents when they are warm (``agents``).
        self.warm = SlurmWarmPath(self)
        base = {
            k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_"))
        }
        conf = cfg.slurm_conf or os.environ.get("SLURM_CONF", "")
        self.env = {**base, "SLURM_CONF": conf} if conf else base

    # -- topology ---------------------------------------------------------------------------
    def topology_conf(self) -> Path | None:
        """The topology.conf read for positions (``topology_conf``, else beside slurm.conf)."""
        if self.cfg.topology_conf:
            return Path(self.cfg.topology_conf)
        conf = self.env.get("SLURM_CONF") or "/etc/slurm/slurm.conf"
        beside = Path(conf).parent / "topology.conf"
        return beside if beside.is_file() else None

    def machine_positions(self, names: list[str]) -> dict[str, MachinePosition]:
        """Pod and rack of ``names`` from topology.conf (none without one)."""
        path = self.topology_conf()
        if path is None:
            return {}
        found = parse_topology_conf(path.read_text(encoding="utf-8"), self.cfg.topology_pod_level)
        return {n: found[n] for n in names if n in found}

    # -- commands ---------------------------------------------------------------------------
    def _record(self, rec: CommandRecord) -> None:
        rec = replace(rec, output="")
        self.commands.append(rec)
        log.info("slurm: %s", rec.summary())
        line = {"ts": time.time(), **asdict(rec)}
        del line["output"]
        with self._lock, (self.dir / "commands.jsonl").open("a") as fh:
            fh.write(json.dumps(line) + "\n")

    def _budget(self, ctx: StepContext, limit: float) -> float:
        left = min(limit, ctx.remaining())
        if left <= 0.05:
            raise TemporaryError(f"step {ctx.step} ran out of time (deadline passed)")
        return left

    def run(
        self, argv: list[str], ctx: StepContext, timeout_s: float | None = None, check: bool = True
    ) -> CommandRecord:
        """Run one Slurm command; a failure raises Temporary/PermanentError when ``check``."""
        timeout = self._budget(ctx, timeout_s or self.cfg.command_timeout_s)
        t0 = time.monotonic()
        try:
            res = subprocess.run(
                argv, capture_output=True, text=True, env=self.env, timeout=timeout, stdin=subprocess.DEVNULL
            )
        except FileNotFoundError as exc:
            raise PermanentError(
                f"{argv[0]} is not installed on the action service's host (Slurm client)"
            ) from exc
        except subprocess.TimeoutExpired as exc:
            rec = CommandRecord(
                argv, None, time.monotonic() - t0, _text(exc.stdout), _text(exc.stderr), ctx.op_id
            )
            self._record(rec)
            raise TemporaryError(f"Slurm did not answer in {timeout:.1f} s: {rec.summary()}") from exc
        rec = CommandRecord(
            argv,
            res.returncode,
            time.monotonic() - t0,
            _tail(res.stdout),
            _tail(res.stderr),
            ctx.op_id,
            res.stdout,
        )
        self._record(rec)
        if check and res.returncode != 0:
            raise classify(rec)
        return rec

    def detail(self, op_id: str, limit: int = 1500) -> str:
        """What this executor changed in Slurm for step ``op_id`` (queries left out), for the
        step's action event: e.g. ``scontrol update NodeName=n2 State=DRAIN ... -> 0``."""
        changes = [
            c.summary()
            for c in self.commands
            if c.op_id == op_id
            and not (c.argv[0] in ("squeue", "sinfo") or c.argv[1:2] in (["-o"], ["ping"]))
        ]
        path = self.last_provision.get("path") if self.last_provision.get("op_id") == op_id else None
        text = "; ".join(([f"provisioned via {path}"] if path else []) + changes)
        return text if len(text) <= limit else text[: limit - 3] + "..."

    # -- queries ----------------------------------------------------------------------------
    def slurm_job_id(self, job: str, ctx: StepContext) -> str:
        if job in self.cfg.job_ids:
            return str(self.cfg.job_ids[job])
        name = self.cfg.job_name.format(job=job)
        argv = ["squeue", "-h", "-n", name, "-o", "%i|%T"]
        if self.cfg.user:
            argv += ["-u", self.cfg.user]
        rows = [ln.split("|") for ln in self.run(argv, ctx).output.splitlines() if "|" in ln]
        if not rows:
            raise PermanentError(f"no Slurm job named {name!r} (TrainGuard job {job}) is queued or running")
        if len(rows) > 1:
            # A reused name: an earlier run still completing, or the next one queued behind it.
            running = [r for r in rows if r[1].strip() == "RUNNING"]
            if len(running) != 1:
                ids = ", ".join(f"{r[0].strip()} {r[1].strip()}" for r in rows)
                raise PermanentError(
                    f"{len(rows)} Slurm jobs are named {name!r} ({ids}), {len(running)} of them running: "
                    f"set user (only one user's jobs) or job_ids[{job!r}]"
                )
            rows = running
        return rows[0][0].strip()

    def show_job(self, job_id: str, ctx: StepContext) -> SlurmJob:
        lines = self.run(["scontrol", "-o", "show", "job", job_id], ctx).output.splitlines()
        f = parse_record(lines[0]) if lines else {}
        if not f:
            raise PermanentError(f"scontrol shows nothing for Slurm job {job_id}")
        return SlurmJob(
            job_id=job_id,
            state=f.get("JobState", ""),
            nodes=expand_hostlist(f.get("NodeList", "")),
            batch=f.get("BatchFlag", "0") == "1",
            partition=f.get("Partition", ""),
            restarts=int(f.get("Restarts", "0") or 0),
            fields=f,
        )

    def allocation(self, job: str, ctx: StepContext) -> SlurmJob:
        """The job's running allocation (TemporaryError while it is pending, Permanent once gone)."""
        j = self.show_job(self.slurm_job_id(job, ctx), ctx)
        if j.state == "RUNNING":
            return j
        if j.state in _COMING:
            raise TemporaryError(f"Slurm job {j.job_id} of {job} is {j.state}, not running yet", delay=2.0)
        raise PermanentError(f"Slurm job {j.job_id} of {job} is {j.state}: its allocation is gone")

    def nodes(self, names: Iterable[str], ctx: StepContext) -> dict[str, dict[str, str]]:
        """``scontrol -o show node`` of ``names`` (all nodes when empty), by node name."""
        names = list(names)
        argv = ["scontrol", "-o", "show", "node"] + ([",".join(names)] if names else [])
        out = {}
        for line in self.run(argv, ctx).output.splitlines():
            rec = parse_record(line)
            if "NodeName" in rec:
                out[rec["NodeName"]] = rec
        return out

    def unusable(self, nodes: dict[str, dict[str, str]]) -> set[str]:
        return {n for n, r in nodes.items() if node_flags(r.get("State", "")) & _BAD_FLAGS}

    def require_usable(self, names: list[str], what: str, ctx: StepContext) -> None:
        """Refuse drained or down nodes (for good) and unresponsive ones (for now)."""
        info = self.nodes(names, ctx)
        bad = self.unusable(info)
        if not bad:
            return
        states = {n: info[n].get("State", "") for n in sorted(bad)}
        if all(node_flags(st) & _BAD_FLAGS == {"NOT_RESPONDING"} for st in states.values()):
            raise TemporaryError(f"{what}: nodes {states} do not respond (yet)", delay=5.0)
        raise PermanentError(f"{what}: nodes {states} are drained or down")

    def steps(self, job_id: str, ctx: StepContext) -> list[SlurmStep]:
        out = self.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j|%N"], ctx).output
        steps = []
        for line in out.splitlines():
            parts = line.split("|")
            if len(parts) == 3:
                steps.append(SlurmStep(parts[0].strip(), parts[1].strip(), expand_hostlist(parts[2])))
        return steps

    def training_steps(self, job_id: str, ctx: StepContext) -> list[SlurmStep]:
        return [
            s
            for s in self.steps(job_id, ctx)
            if s.numeric and s.name not in self.cfg.keep_steps and not s.name.startswith(_OWN)
        ]

    # -- state ------------------------------------------------------------------------------
    def _job_path(self, job: str, *parts: str) -> Path:
        """``<state dir>/slurm/<parts...>``, built from ``job``'s name: refused (PermanentError)
        unless the name is a valid job name and the path, resolved, stays inside the directory.

        Names are checked where specs are decoded (``trainguard.schemas.names``); this is the
        second line, because the service runs as root or SlurmUser and a name like
        ``../../etc/cron.d/x`` would otherwise be a file written anywhere."""
        _check_job(job)
        base = self.dir.resolve()
        path = self.dir.joinpath(*parts)
        if not path.resolve().is_relative_to(base) or path.resolve() == base:
            raise PermanentError(f"slurm executor: {path} of job {job!r} is not inside {self.dir}")
        return path

    def _state_file(self, job: str) -> Path:
        return self._job_path(job, f"{job}.json")

    def _load(self, job: str) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(self._state_file(job).read_text())
        except (OSError, ValueError):
            data = {}
        # Steps are numbered per job name (step-<n>.log never mixes two runs); op ids are unique.
        data.setdefault("generation", 0)
        data.setdefault("provisioned", {})
        data.setdefault("requeue", {})
        #: Slurm job id -> {"known": nodes handed out in that run}.
        data.setdefault("runs", {})
        if "known" in data:  # written before runs were told apart: the run that asks next owns it
            data["unclaimed"] = data.pop("known")
        return data

    def _known(self, data: dict[str, Any], job_id: str) -> list[str]:
        """The nodes handed out in Slurm job ``job_id`` (the list in ``data``, to update in place)."""
        runs: dict[str, Any] = data["runs"]
        if job_id not in runs:
            runs[job_id] = {"known": data.pop("unclaimed", [])}
            for old in list(runs)[:-RUNS_KEPT]:
                del runs[old]
        known: list[str] = runs[job_id]["known"]
        return known

    def _save(self, job: str, data: dict[str, Any]) -> None:
        tmp = self._state_file(job).with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, self._state_file(job))

    def _bump_generation(self, job: str, generation: int) -> None:
        """A warm restart's generation: the next cold step's ``TRAINGUARD_RESTART`` comes after it."""
        data = self._load(job)
        if data["generation"] < generation:
            data["generation"] = generation
            self._save(job, data)

    def _set_agent_code(self, job: str, version: str) -> None:
        """A hot update the job's agents have not restarted on yet (the next restart carries it)."""
        data = self._load(job)
        data["agent_code"] = version
        self._save(job, data)

    def _take_agent_code(self, job: str) -> str:
        """The pending hot update's version for this restart ("" when none), consumed."""
        data = self._load(job)
        version = str(data.pop("agent_code", "") or "")
        if version:
            self._save(job, data)
        return version

    def _remember(self, spec: JobSpec, job_id: str, extra: Iterable[str] = ()) -> None:
        """Nodes seen in a spec are handed out in Slurm job ``job_id``: provision_standbys never
        returns them as new there."""
        data = self._load(spec.job)
        new_run = job_id not in data["runs"]
        known = self._known(data, job_id)
        more = (set(spec.topology.machines) | set(spec.standbys) | set(extra)) - set(known)
        if more or new_run:
            known[:] = sorted(set(known) | more)
            self._save(spec.job, data)

    # -- the protocol -----------------------------------------------------------------------
    def unconfigured(self) -> dict[str, str]:
        """Protocol methods this configuration cannot perform, and the option to set."""
        cfg = self.cfg
        return unconfigured_commands(
            cfg.replay_command, cfg.diagnostic_commands, ("step_command", bool(cfg.step_command))
        )

    def usable_machines(self, spec: JobSpec, candidates: list[str], ctx: StepContext) -> list[str]:
        """The nodes of the job's allocation that Slurm reports usable now (neither drained nor
        down), in allocation order; ``candidates`` outside the allocation are not usable (a
        standby must be a node of the allocation)."""
        alloc = self.allocation(spec.job, ctx)
        info = self.nodes(alloc.nodes, ctx)
        bad = self.unusable(info)
        return [n for n in alloc.nodes if n in info and n not in bad]

    def prepare(self) -> None:
        try:
            self.run(["scontrol", "ping"], _ctx("prepare", self.cfg.command_timeout_s))
        except (TemporaryError, PermanentError) as exc:
            log.warning("slurm executor: the controller does not answer yet: %s", exc)

    def stop(self, spec: JobSpec, ctx: StepContext) -> None:
        job_id = self.slurm_job_id(spec.job, ctx)
        self._remember(spec, job_id)
        if self.cfg.agents and self.warm.stop(spec, job_id, ctx):
            return  # the ranks are stopped, their agents stay warm for the restart
        self._cancel_training(job_id, ctx)

    def _cancel_training(self, job_id: str, ctx: StepContext) -> None:
        steps = self.training_steps(job_id, ctx)
        if not steps:
            return  # nothing runs: stopping a stopped job is a no-op
        ids = [s.step_id for s in steps]
        rec = self.run(["scancel", *ids], ctx, check=False)
        if rec.rc != 0:
            # A step that ended between the listing and scancel ("Invalid job id specified": srun's
            # --kill-on-bad-exit ends the step a moment after a rank dies) is stopped, which is
            # what was asked; only a step still listed makes the failure one (measured: a
            # recovery held for an operator, the job left dead, on this race).
            still = [i for i in ids if i in {s.step_id for s in self.training_steps(job_id, ctx)}]
            if still:
                raise classify(rec)
            log.info("slurm: steps %s ended before scancel reached them: stopped", ids)
        deadline = time.monotonic() + self._budget(ctx, self.cfg.stop_timeout_s)
        while True:
            left = [s.step_id for s in self.training_steps(job_id, ctx)]
            if not left:
                return
            if time.monotonic() >= deadline:
                raise TemporaryError(f"steps {left} of Slurm job {job_id} still run after scancel", delay=1.0)
            time.sleep(0.2)

    def evict(self, spec: JobSpec, machines: list[str], ctx: StepContext) -> None:
        alloc = self.show_job(self.slurm_job_id(spec.job, ctx), ctx)
        self._remember(spec, alloc.job_id)
        info = self.nodes(machines, ctx)
        missing = [m for m in machines if m not in info]
        if missing:
            raise PermanentError(f"no Slurm node named {missing}")
        drained = {
            m for m in machines if node_flags(info[m].get("State", "")) & {"DRAIN", "DRAINED", "DRAINING"}
        }
        outside = [m for m in machines if m not in alloc.nodes and m not in drained]
        if outside:
            raise PermanentError(
                f"refusing to drain {outside}: not part of Slurm job {alloc.job_id} of {spec.job} "
                f"(its nodes: {alloc.nodes})"
            )
        # What an operator reading `sinfo -R` needs: which decision, for what fault, of which job.
        reason = f"trainguard {ctx.decision_id}: {ctx.category or ctx.step} in {spec.job}"
        for m in machines:
            if m in drained:
                log.info("slurm: %s is drained already (%s): no-op", m, info[m].get("Reason", ""))
                continue
            self.run(["scontrol", "update", f"NodeName={m}", "State=DRAIN", f"Reason={reason}"], ctx)

    def activate_standbys(
        self, spec: JobSpec, standbys: list[str], replaces: list[str], ctx: StepContext
    ) -> None:
        # The new step itself starts in restart() (the plan's next step): starting it here too
        # would launch it twice.  Here: the standbys are fit to take their places.
        alloc = self.allocation(spec.job, ctx)
        self._remember(spec, alloc.job_id, standbys)
        outside = [s for s in standbys if s not in alloc.nodes]
        if outside:
            raise PermanentError(f"standbys {outside} are not in Slurm job {alloc.job_id} of {spec.job}")
        self.require_usable(standbys, f"cannot activate standbys of {spec.job}", ctx)
        if self.cfg.check_standbys and standbys:
            self.run(
                [
                    "srun",
                    f"--jobid={alloc.job_id}",
                    f"--job-name={CHECK}",
                    "--overlap",
                    f"--nodes={len(standbys)}",
                    f"--ntasks={len(standbys)}",
                    "--ntasks-per-node=1",
                    f"--nodelist={','.join(standbys)}",
                    "true",
                ],
                ctx,
                timeout_s=self.cfg.launch_timeout_s,
            )

    def restart(self, spec: JobSpec, ctx: StepContext) -> None:
        if not self.cfg.step_command:
            raise PermanentError("slurm executor: no step_command configured to (re)start the training step")
        nodes = list(spec.topology.machines)
        if not nodes:
            raise PermanentError(f"the spec of {spec.job} names no machines (Slurm nodes) to restart on")
        alloc = self.allocation(spec.job, ctx)
        self._remember(spec, alloc.job_id)
        outside = [n for n in nodes if n not in alloc.nodes]
        if outside:
            raise PermanentError(f"nodes {outside} are not in Slurm job {alloc.job_id} of {spec.job}")
        self.require_usable(nodes, f"refusing to restart {spec.job}", ctx)
        if self.cfg.agents and self.warm.restart(spec, alloc.job_id, nodes, ctx):
            return  # restarted in place by the agents: the same step, no new srun
        name = f"{TRAIN}.{ctx.op_id[:12]}"
        running = self.training_steps(alloc.job_id, ctx)
        if any(s.name == name and sorted(s.nodes) == sorted(nodes) for s in running):
            return  # this restart ran already (the service crashed after it): no-op
        if running:
            self._cancel_training(alloc.job_id, ctx)  # a restart always starts every rank afresh
        data = self._load(spec.job)
        data["generation"] += 1
        self._save(spec.job, data)
        gen = data["generation"]
        tpn = self.cfg.tasks_per_node or spec.topology.ranks_per_machine
        logfile = self._job_path(spec.job, spec.job, f"step-{gen}.log")
        logfile.parent.mkdir(parents=True, exist_ok=True)
        # Ranks in the spec's node order (a spare in the evicted node's place keeps that node's
        # ranks, so the topology's parallel groups stay what the workers think they are); block
        # placement would follow Slurm's sorted node order instead.  With the arbitrary
        # distribution the node list is the task layout, a node per task.  The launcher reads
        # the same order from TRAINGUARD_NODES.
        layout = ",".join(n for n in nodes for _ in range(tpn))
        argv = [
            "srun", f"--jobid={alloc.job_id}", f"--job-name={name}", f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes) * tpn}", "--distribution=arbitrary", f"--nodelist={layout}",
            "--kill-on-bad-exit=1", *self.cfg.srun_args, *self.cfg.step_command,
        ]  # fmt: skip
        env = {
            **self.env,
            # srun fills %x of --output/--error (srun_args) from SLURM_JOB_NAME, which the
            # service's environment lacks (SLURM_* are dropped): %x was "(null)".  Within an
            # allocation srun takes no step name from it (--job-name above names the step).
            "SLURM_JOB_NAME": alloc.fields.get("JobName", ""),
            "TRAINGUARD_JOB": spec.job,
            "TRAINGUARD_NODES": ",".join(nodes),
            "TRAINGUARD_RESTART": str(gen),
            "TRAINGUARD_DECISION": ctx.decision_id,
            "TRAINGUARD_CODE_VERSION": self._version(spec.job),
        }
        t0 = time.monotonic()
        with logfile.open("ab") as out:
            # Detached: its own session, so the step outlives a restart of the action service.
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self._launched[spec.job] = proc
        self._record(
            CommandRecord(argv, None, time.monotonic() - t0, f"pid {proc.pid}, log {logfile}", "", ctx.op_id)
        )
        deadline = time.monotonic() + self._budget(ctx, self.cfg.launch_timeout_s)
        while True:
            if any(s.name == name for s in self.training_steps(alloc.job_id, ctx)):
                return
            rc = proc.poll()
            if rc is not None:
                tail = _tail(logfile.read_text(errors="replace"))
                rec = CommandRecord(argv, rc, time.monotonic() - t0, tail, "", ctx.op_id)
                self._record(rec)
                if rc == 0:
                    return  # the step ran and finished already
                raise classify(rec, f"the training step of {spec.job} failed at launch")
            if time.monotonic() >= deadline:
                proc.terminate()
                raise TemporaryError(
                    f"the training step of {spec.job} did not appear in Slurm in time; see {logfile}"
                )
            time.sleep(0.2)

    def provision_standbys(self, job: str, count: int, ctx: StepContext) -> list[str]:
        data = self._load(job)
        if ctx.op_id in data["provisioned"]:  # a re-run step gets the nodes it got before
            return list(data["provisioned"][ctx.op_id])
        alloc = self.show_job(self.slurm_job_id(job, ctx), ctx)
        pending = data["requeue"].get(ctx.op_id)
        if pending is not None:  # the service crashed while the job was being requeued
            got = self._finish_requeue(job, alloc, pending, count, ctx)
            return self._provided(job, alloc.job_id, ctx, got, "requeue", pending.get("why", []))
        if alloc.state != "RUNNING":
            raise TemporaryError(f"Slurm job {alloc.job_id} of {job} is {alloc.state}", delay=2.0)
        info = self.nodes(alloc.nodes, ctx)
        bad = self.unusable(info)
        known = self._known(data, alloc.job_id)
        free = [n for n in alloc.nodes if n not in bad and n not in known]
        if len(free) >= count:
            return self._provided(job, alloc.job_id, ctx, free[:count], "spare")
        need = count - len(free)
        why = []
        if self.cfg.allow_expand:
            try:
                got = free + self._expand(job, alloc, need, ctx)
                return self._provided(job, alloc.job_id, ctx, got, "expand")
            except (TemporaryError, PermanentError) as exc:
                why.append(f"expand: {exc}")
        if not self.cfg.allow_requeue:
            raise PermanentError(
                f"no spare nodes for {job} ({'; '.join(why) or 'growing is disabled'}); requeue is disabled"
            )
        if not alloc.batch:
            raise PermanentError(
                f"no spare nodes for {job} ({'; '.join(why)}) and Slurm job {alloc.job_id} is not "
                "a batch job (cannot requeue)"
            )
        running = self.training_steps(alloc.job_id, ctx)
        if running:  # e.g. replenishing the pool after a restart: a spare is not worth a requeue
            raise PermanentError(
                f"no spare nodes for {job} ({'; '.join(why)}) and a requeue would kill its running "
                f"training step {running[0].step_id}"
            )
        kept = [n for n in alloc.nodes if n not in bad]
        partition = self.cfg.partition or alloc.partition
        everyone = self.nodes([], ctx)
        others = [
            n
            for n, r in everyone.items()
            if n not in alloc.nodes and partition in r.get("Partitions", "").split(",")
        ]
        candidates = [n for n in others if n not in self.unusable(everyone)]
        if len(candidates) < need:  # requeued, the job would wait in the queue for nodes nobody has
            raise PermanentError(
                f"no spare nodes for {job} ({'; '.join(why)}) and only {len(candidates)} healthy nodes "
                f"outside its allocation in partition {partition}: {need} needed"
            )
        pending = {
            "kept": kept,
            "excluded": sorted(bad),
            "restarts": alloc.restarts,
            # The job keeps its size (the bad nodes' places refill the spare pool), or grows by
            # what is missing.
            "nodes": max(len(alloc.nodes), len(kept) + need),
            "why": why,
        }
        data["requeue"][ctx.op_id] = pending
        self._save(job, data)
        log.warning(
            "slurm: %s has no spare node and cannot grow (%s): requeueing Slurm job %s",
            job,
            "; ".join(why),
            alloc.job_id,
        )
        got = self._finish_requeue(job, alloc, pending, count, ctx)
        return self._provided(job, alloc.job_id, ctx, got, "requeue", why)

    def _provided(
        self, job: str, job_id: str, ctx: StepContext, names: list[str], path: str, why: Iterable[str] = ()
    ) -> list[str]:
        data = self._load(job)
        data["provisioned"][ctx.op_id] = names
        known = self._known(data, job_id)
        known[:] = sorted(set(known) | set(names))
        data["requeue"].pop(ctx.op_id, None)
        self._save(job, data)
        self.last_provision = {"job": job, "path": path, "nodes": names, "why": list(why), "op_id": ctx.op_id}
        log.info("slurm: provisioned %s for %s via %s", names, job, path)
        return names

    def _expand(self, job: str, alloc: SlurmJob, need: int, ctx: StepContext) -> list[str]:
        """Grow the allocation by ``need`` nodes: a standby job merged into it (Slurm's job expansion)."""
        name = f"{self.cfg.job_name.format(job=job)}.standby-{ctx.op_id[:12]}"
        nodes = self.nodes([], ctx)
        exclude = sorted(set(alloc.nodes) | self.unusable(nodes))
        found = self.run(["squeue", "-h", "-n", name, "-o", "%i|%T"], ctx).output.split()
        if not found:  # not allocated by an earlier attempt of this step
            # Half the time at most: the requeue fallback needs the rest.
            wait = max(1, int(min(self.cfg.provision_timeout_s, ctx.remaining()) / 2))
            argv = [
                "salloc", "--no-shell", f"--immediate={wait}", f"--nodes={need}", "--ntasks-per-node=1",
                f"--job-name={name}", f"--partition={self.cfg.partition or alloc.partition}",
                f"--dependency=expand:{alloc.job_id}",
            ]  # fmt: skip
            if exclude:
                argv.append(f"--exclude={','.join(exclude)}")
            res = self.run(argv, ctx, timeout_s=self.cfg.provision_timeout_s + 5, check=False)
            if res.rc != 0:
                raise TemporaryError(f"no standby allocation: {res.summary()}")
            found = self.run(["squeue", "-h", "-n", name, "-o", "%i|%T"], ctx).output.split()
        if not found:
            raise TemporaryError(f"standby job {name} vanished before it was merged")
        extra_id = found[0].split("|")[0]
        extra = self.show_job(extra_id, ctx)
        try:
            self.run(["scontrol", "update", f"JobId={extra_id}", "NumNodes=0"], ctx)
        except (TemporaryError, PermanentError):
            self.run(["scancel", extra_id], ctx, check=False)
            raise
        # Refreshes the job's size; Slurm may answer "try again" although the merge is done.
        self.run(["scontrol", "update", f"JobId={alloc.job_id}", "NumNodes=ALL"], ctx, check=False)
        grown = self.show_job(alloc.job_id, ctx)
        new = [n for n in extra.nodes if n in grown.nodes]
        if len(new) < need:
            raise TemporaryError(
                f"standby nodes {extra.nodes} did not join Slurm job {alloc.job_id} ({grown.nodes})"
            )
        return new[:need]

    def _finish_requeue(
        self, job: str, alloc: SlurmJob, pending: dict[str, Any], count: int, ctx: StepContext
    ) -> list[str]:
        """Requeue (once) with the bad nodes excluded and the healthy ones required; wait for it to run."""
        jid = alloc.job_id
        if alloc.restarts <= pending["restarts"] and alloc.state == "RUNNING":
            self.run(["scontrol", "requeuehold", jid], ctx)
        update = [
            "scontrol",
            "update",
            f"JobId={jid}",
            f"ReqNodeList={','.join(pending['kept'])}",
            "StartTime=now",
        ]
        if pending["excluded"]:
            update.append(f"ExcNodeList={','.join(pending['excluded'])}")
        if pending["nodes"] != len(alloc.nodes):
            update.append(f"NumNodes={pending['nodes']}")
        old_nodes = pending["kept"] + pending["excluded"]
        deadline = time.monotonic() + self._budget(ctx, self.cfg.provision_timeout_s) - 1.0
        updated = released = False
        cleared: float | None = None
        while True:
            j = self.show_job(jid, ctx)
            if j.state == "RUNNING" and j.restarts > pending["restarts"]:
                break
            if j.state not in _COMING:
                raise PermanentError(
                    f"requeued Slurm job {jid} of {job} ended {j.state} ({j.fields.get('Reason')}) "
                    "instead of starting again; see slurmctld.log"
                )
            if j.state in ("PENDING", "REQUEUE_HOLD") and not updated:
                updated = self.run(update, ctx, check=False).rc == 0
            if updated and not released:
                # Release only once the old nodes are done with the old run, and a second later:
                # a node refuses a credential issued within the second its job's old one was
                # revoked ("Job credential revoked", the batch job fails) -- the reason Slurm
                # holds requeued jobs back two minutes, which StartTime=now skips.
                info = self.nodes(old_nodes, ctx)
                if any("COMPLETING" in node_flags(r.get("State", "")) for r in info.values()):
                    cleared = None
                elif cleared is None:
                    cleared = time.monotonic()
                elif time.monotonic() - cleared >= 1.1:
                    self.run(["scontrol", "release", jid], ctx, check=False)
                    released = True
            if time.monotonic() >= deadline:
                raise TemporaryError(
                    f"requeued Slurm job {jid} of {job} is {j.state} ({j.fields.get('Reason')})", delay=2.0
                )
            time.sleep(0.3)
        new = [n for n in j.nodes if n not in pending["kept"]]
        free = [n for n in pending["kept"] if n not in self._known(self._load(job), jid)]
        got = (free + new)[:count]
        if len(got) < count:
            raise PermanentError(
                f"requeued Slurm job {jid} of {job} got nodes {j.nodes}: {len(got)} new of {count} wanted"
            )
        return got

    def hot_update(self, spec: JobSpec, version: str, ctx: StepContext) -> None:
        # Only the switch: every plan restarts the step next, and the new step gets the version
        # (TRAINGUARD_CODE_VERSION and the version file).
        if self._version(spec.job) == version:
            return
        if self.cfg.hot_update_command:
            argv = [a.format(job=spec.job, version=version) for a in self.cfg.hot_update_command]
            rec = self.run(argv, ctx, check=False)
            if rec.rc != 0:
                raise PermanentError(f"hot update of {spec.job} to {version} failed: {rec.summary()}")
        path = self._version_file(spec.job)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(version + "\n")
        os.replace(tmp, path)
        if self.cfg.agents:  # the restart that follows carries the version; pre-warm it now
            self.warm.code(spec, self.slurm_job_id(spec.job, ctx), version, ctx)

    def _version_file(self, job: str) -> Path:
        if self.cfg.version_file:  # the site's own template: the name is one path component in it
            _check_job(job)
            return Path(self.cfg.version_file.format(job=job))
        return self._job_path(job, job, "code_version")

    def _version(self, job: str) -> str:
        try:
            return self._version_file(job).read_text().strip()
        except OSError:
            return ""

    def run_diagnostics(
        self, spec: JobSpec, machines: list[str], tests: list[str], ctx: StepContext
    ) -> list[DiagnosticResult]:
        unknown = [t for t in tests if t not in self.cfg.diagnostic_commands]
        if unknown:
            raise PermanentError(f"no diagnostic command configured for {unknown}")
        alloc = self.allocation(spec.job, ctx)
        outside = [m for m in machines if m not in alloc.nodes]
        if outside:
            raise PermanentError(f"cannot test {outside}: not in Slurm job {alloc.job_id} of {spec.job}")
        results = []
        for test in tests:
            t0 = time.monotonic()
            per_node = self._on_nodes(
                alloc.job_id,
                f"{DIAG}.{test}",
                machines,
                self.cfg.diagnostic_commands[test],
                ctx,
                self.cfg.diagnostics_timeout_s,
            )
            ms = (time.monotonic() - t0) * 1000
            for m in machines:
                rc, out = per_node.get(m, (None, "no result (the node did not run the test in time)"))
                results.append(
                    DiagnosticResult(
                        machine=m,
                        test=test,
                        passed=rc == 0,
                        detail=f"exit {rc}: {out}"[-500:],
                        duration_ms=ms,
                    )
                )
        return results

    def _on_nodes(
        self,
        job_id: str,
        name: str,
        nodes: list[str],
        command: list[str],
        ctx: StepContext,
        limit: float,
        env: dict[str, str] | None = None,
    ) -> dict[str, tuple[int | None, str]]:
        """Run ``command`` once on each node as one step; each node's (exit code, output tail)."""
        # Each task reports its node and exit code on its last line, so one failing node does not
        # hide the others' results (srun's own exit code is the worst of them).
        script = f'{shlex.join(command)}; rc=$?; echo "TGRESULT $SLURMD_NODENAME $rc"; exit 0'
        argv = [
            "srun", f"--jobid={job_id}", f"--job-name={name}", "--overlap", f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes)}", "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}", "--label",
            "bash", "-c", script,
        ]  # fmt: skip
        timeout = self._budget(ctx, limit)
        t0 = time.monotonic()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**self.env, **(env or {})},
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            # Cancel the step (found by name) past the step's deadline: it must not linger.
            grace = replace(ctx, deadline=time.monotonic() + self.cfg.command_timeout_s)
            with contextlib.suppress(TemporaryError, PermanentError):
                for st in self.steps(job_id, grace):
                    if st.name == name:
                        self.run(["scancel", st.step_id], grace, check=False)
            proc.terminate()
            try:
                stdout, stderr = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
            rc = None
        rec = CommandRecord(argv, rc, time.monotonic() - t0, _tail(stdout), _tail(stderr), ctx.op_id)
        self._record(rec)
        by_task: dict[str, list[str]] = {}
        results: dict[str, tuple[int | None, str]] = {}
        for line in stdout.splitlines():
            task, _, text = line.partition(": ")
            by_task.setdefault(task.strip(), []).append(text)
            parts = text.split()
            if len(parts) == 3 and parts[0] == "TGRESULT" and parts[2].lstrip("-").isdigit():
                out = "\n".join(by_task[task.strip()][:-1])[-300:]
                results[parts[1]] = (int(parts[2]), out)
        if not results and rc not in (0, None):
            raise classify(rec, f"step {name} did not start")  # Slurm refused the step
        return results

    def run_replay(self, spec: JobSpec, groups: list[list[str]], ctx: StepContext) -> list[bool]:
        if not self.cfg.replay_command:
            raise PermanentError("no replay_command configured for the slurm executor")
        alloc = self.allocation(spec.job, ctx)
        outside = sorted({m for g in groups for m in g if m not in alloc.nodes})
        if outside:
            raise PermanentError(f"cannot replay on {outside}: not in Slurm job {alloc.job_id} of {spec.job}")
        out: list[bool] = [False] * len(groups)
        errors: list[Exception] = []
        threads = []

        def one(i: int, group: list[str]) -> None:
            try:
                # A group that hangs past the timeout fails like one that exits non-zero.
                out[i] = verdict(i, group)
            except Exception as exc:  # Slurm refused the step: not a verdict on the group
                errors.append(exc)

        def verdict(i: int, group: list[str]) -> bool:
            env = {
                "TRAINGUARD_JOB": spec.job,
                "TRAINGUARD_NODES": ",".join(group),
                "TRAINGUARD_REPLAY_GROUP": str(i),
            }
            res = self._on_nodes(
                alloc.job_id,
                f"{REPLAY}.{i}",
                group,
                self.cfg.replay_command,
                ctx,
                self.cfg.replay_timeout_s,
                env,
            )
            return len(res) == len(group) and all(rc == 0 for rc, _ in res.values())

        for i, group in enumerate(groups):  # the groups are disjoint: all at once
            t = threading.Thread(target=one, args=(i, list(group)), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out

    def close(self) -> None:
        # Launched steps keep running on purpose (they are the job); only reap finished sruns.
        for proc in self._launched.values():
            proc.poll()


def classify(rec: CommandRecord, what: str = "") -> PermanentError | TemporaryError:
    """A failed command as the error the step runner understands."""
    text = f"{rec.stderr}\n{rec.stdout}".lower()
    msg = f"{what + ': ' if what else ''}{rec.summary()}"
    if any(p in text for p in _PERMANENT):
        return PermanentError(msg)
    return TemporaryError(msg)  # controller unreachable, timeouts, busy nodes: may pass


def _check_job(job: str) -> None:
    why = names.JOB.problem(job)
    if why is not None:
        raise PermanentError(f"slurm executor: job {why}: no file is named after it")


def _ctx(step: str, seconds: float) -> StepContext:
    return StepContext(decision_id="", step=step, attempt=1, deadline=time.monotonic() + seconds)


def _text(data: str | bytes | None) -> str:
    if isinstance(data, bytes):
        data = data.decode(errors="replace")
    return _tail(data or "")


def _tail(text: str, limit: int = 2000) -> str:
    return text[-limit:]


PLUGIN = ExecutorPlugin("slurm", SlurmExecutorConfig, SlurmExecutor)
