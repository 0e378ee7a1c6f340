"""A private local Slurm cluster for the embedded stack: ``munged``, ``slurmctld`` and N ``slurmd``.

``trainguard stack up --slurm`` runs Debian's ``slurm-wlm`` and ``munge`` as plain processes owned
by the stack home: every path (munge key, socket, pid and log files, state and spool dirs) lives
under ``<home>/slurm``, and every daemon listens on its own port, so a system munge or Slurm on the
same host is never touched.  The N nodes are one ``slurmd`` each (``slurmd -N nX``), all on
127.0.0.1 -- several ``slurmd`` per host work when each has its own node name and port.

Clients reach this cluster with ``SLURM_CONF=<home>/slurm/slurm.conf`` (:meth:`Slurm.env`); the
conf's ``AuthInfo=socket=...`` points them at the private munge socket.  ``stack.slurm_prolog``
adds a ``Prolog`` (TrainGuard's preflight, ``infra/deploy/prolog.sh``), off by default.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.infra.config import StackConfig
from trainguard.infra.stack.procs import ManagedProcess, StackError, port_in_use, wait_until
from trainguard.schemas.typecheck import bounds

_PORT = bounds(1, 65535)

_CONF = """\
# Written by `trainguard stack up --slurm`; regenerated on every start (edits are lost).
ClusterName=trainguard
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={first_node_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/run/slurmctld.pid
SlurmdPidFile={dir}/run/slurmd-%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd-%n.log
# No cgroups in containers or CI: track processes by parentage, bind no tasks.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# A node that comes back after a restart is usable at once (no manual RESUME after `stack up`).
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=60
NodeName={nodes} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports} CPUs={cpus} RealMemory={mem}
# OverSubscribe=FORCE: the nodes share this host's cores; jobs must not wait for each other.
PartitionName={partition} Nodes={nodes} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""

_PROLOG = """\
# stack.slurm_prolog: every node of a job runs the prolog when the job is allocated (Alloc), before
# any of its steps; the batch script starts once it passed on all of them (DeferBatch).  A failed
# prolog drains the node and requeues the job{hold_note}.
Prolog={prolog}
PrologFlags=Alloc,DeferBatch
"""
_NOHOLD = "SchedulerParameters=nohold_on_prolog_fail\n"


@dataclass(frozen=True)
class SlurmConfig:
    """Shape and ports of the private Slurm cluster (from ``stack.slurm_*``)."""

    nodes: int = field(default=6, metadata=bounds(1, 64))
    cpus_per_node: int = field(default=2, metadata=bounds(1, 1024))
    memory_mb_per_node: int = field(default=2000, metadata=bounds(100, 10_000_000))
    ctld_port: int = field(default=16817, metadata=_PORT)
    #: node nX listens on ``first_node_port + X - 1``.
    first_node_port: int = field(default=17001, metadata=_PORT)
    partition: str = "train"
    #: ``Prolog=`` (absolute path) and whether a failed one holds the job (``stack.slurm_prolog*``).
    prolog: str = ""
    prolog_hold: bool = False

    def __post_init__(self) -> None:
        if self.prolog and not os.path.isabs(self.prolog):
            raise ValueError(f"slurm prolog {self.prolog!r} must be an absolute path (slurmd runs it from /)")
        # The schema bounds are checked by load_config; a direct construction is checked here.
        if not 1 <= self.nodes <= 64:
            raise ValueError("slurm nodes must be between 1 and 64")
        if self.first_node_port + self.nodes - 1 > 65535:
            raise ValueError("slurm node ports run past 65535: lower first_node_port")
        lo, hi = self.first_node_port, self.first_node_port + self.nodes - 1
        if lo <= self.ctld_port <= hi:
            raise ValueError(f"slurm ctld_port {self.ctld_port} lies in the node ports {lo}-{hi}")

    @classmethod
    def from_stack(cls, cfg: StackConfig, nodes: int | None = None) -> SlurmConfig:
        return cls(
            nodes=cfg.slurm_nodes if nodes is None else nodes,
            cpus_per_node=cfg.slurm_cpus_per_node,
            ctld_port=cfg.slurm_ctld_port,
            first_node_port=cfg.slurm_first_node_port,
            prolog=cfg.slurm_prolog,
            prolog_hold=cfg.slurm_prolog_hold,
        )

    @property
    def node_names(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.nodes + 1)]

    @property
    def ports(self) -> list[int]:
        return [self.ctld_port, *range(self.first_node_port, self.first_node_port + self.nodes)]


def slurm_conf(cfg: SlurmConfig, dir: Path, munge_socket: Path) -> str:
    last = cfg.first_node_port + cfg.nodes - 1
    conf = _CONF.format(
        dir=dir,
        ctld_port=cfg.ctld_port,
        first_node_port=cfg.first_node_port,
        munge_socket=munge_socket,
        nodes=f"n[1-{cfg.nodes}]" if cfg.nodes > 1 else "n1",
        ports=f"[{cfg.first_node_port}-{last}]" if cfg.nodes > 1 else str(last),
        cpus=cfg.cpus_per_node,
        mem=cfg.memory_mb_per_node,
        partition=cfg.partition,
    )
    if not cfg.prolog:
        return conf
    hold_note = " held, until released" if cfg.prolog_hold else ", to start on other nodes (no hold)"
    conf += _PROLOG.format(prolog=cfg.prolog, hold_note=hold_note)
    return conf if cfg.prolog_hold else conf + _NOHOLD


#: long node states (sinfo %T) of a node that registered and answers; a trailing ``*`` means it
#: does not answer, ``down``/``unknown``/``future`` that it is not (yet) in service.
_UP_STATES = {"idle", "mixed", "allocated", "completing", "drained", "draining", "planned", "reserved"}


def _up(state: str) -> bool:
    """
    >>> _up("idle"), _up("drained"), _up("mixed"), _up("idle*"), _up("down"), _up("unknown")
    (True, True, True, False, False, False)
    """
    return state in _UP_STATES


def _binary(name: str) -> str:
    # Debian puts the daemons in /usr/sbin, which is not on every user's PATH.
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin")
    if path is None:
        raise StackError(f"{name} not installed: run scripts/setup.sh (apt-get install slurm-wlm munge)")
    return path


class Slurm:
    """Start, stop and inspect the stack home's private munge + Slurm cluster."""

    def __init__(self, stack: StackConfig, nodes: int | None = None) -> None:
        self.stack = stack
        self.dir = stack.home_path / "slurm"
        self.conf_file = self.dir / "slurm.conf"
        self.munge_dir = self.dir / "munge"
        self.munge_socket = self.munge_dir / "munge.socket"
        self.key_file = self.munge_dir / "munge.key"
        self.cfg = SlurmConfig.from_stack(stack, nodes if nodes is not None else self._running_nodes())
        pids = self.dir / "pids"
        logs = self.dir / "log"
        # Ownership markers: munged's is our private socket path, the Slurm daemons' our conf path
        # (both unique to this home, so a system munge/Slurm is never mistaken for ours).
        self.munged = ManagedProcess(
            "munged", pids / "munged.pid", logs / "munged.out", str(self.munge_socket)
        )
        self.ctld = ManagedProcess(
            "slurmctld", pids / "slurmctld.pid", logs / "slurmctld.out", str(self.conf_file)
        )

    def _running_nodes(self) -> int | None:
        """The node count of the cluster this home runs (from its pid files), None if none runs."""
        names = [p.stem.removeprefix("slurmd-") for p in (self.dir / "pids").glob("slurmd-n*.pid")]
        nums = [int(n[1:]) for n in names if n[1:].isdigit()]
        return max(nums) if nums else None

    def slurmd(self, node: str) -> ManagedProcess:
        return ManagedProcess(
            f"slurmd {node}",
            self.dir / "pids" / f"slurmd-{node}.pid",
            self.dir / "log" / f"slurmd-{node}.out",
            str(self.conf_file),
        )

    def env(self) -> dict[str, str]:
        """The environment for Slurm clients (srun, sinfo, scontrol) talking to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf_file)}

    # -- lifecycle --------------------------------------------------------------------------
    def running(self) -> bool:
        return self.ctld.pid() is not None

    def check_ports(self) -> None:
        if self.running():
            return
        for port in self.cfg.ports:
            if port_in_use(port):
                raise StackError(
                    f"port {port} is already in use by another process; choose other Slurm ports with "
                    "stack.slurm_ctld_port / stack.slurm_first_node_port "
                    "(TRAINGUARD__STACK__SLURM_CTLD_PORT, TRAINGUARD__STACK__SLURM_FIRST_NODE_PORT)."
                )

    def start(self) -> list[str]:
        """Start whatever is not running yet; returns the names started now."""
        munged, slurmctld, slurmd = _binary("munged"), _binary("slurmctld"), _binary("slurmd")
        if self.running():
            want = self._running_nodes()
            if want is not None and want != self.cfg.nodes:
                raise StackError(
                    f"the Slurm of {self.stack.home_path} runs with {want} nodes, not {self.cfg.nodes}: "
                    "run `trainguard stack down` first to change the node count"
                )
        else:
            self.check_ports()
        started: list[str] = []
        for sub in ("state", "run", "log", "pids", "spool"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.munge_dir.mkdir(parents=True, exist_ok=True)
        # munged refuses directories and keys others can write or read.
        self.dir.chmod(0o700)
        self.munge_dir.chmod(0o700)
        if self.munged.pid() is None:
            self._ensure_key()
            self.munge_socket.unlink(missing_ok=True)  # a stale socket of a killed munged
            argv = [
                munged,
                "--foreground",  # so the pid we record is the daemon's own
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={self.key_file}",
                f"--pid-file={self.munge_dir / 'munged.pid'}",
                f"--log-file={self.dir / 'log' / 'munged.log'}",
                f"--seed-file={self.munge_dir / 'munged.seed'}",
            ]
            self.munged.start(argv)
            started.append("munged")
            wait_until(self.munge_socket.exists, 20, "munged", self.munged)
        if self.ctld.pid() is None:
            self._check_prolog()
            self.conf_file.write_text(slurm_conf(self.cfg, self.dir, self.munge_socket))
            for node in self.cfg.node_names:
                (self.dir / "spool" / node).mkdir(parents=True, exist_ok=True)
            # -c: start from a clean state (no jobs or node states of an earlier run); -i: ignore
            # state files that do not match this conf.
            self.ctld.start([slurmctld, "-D", "-c", "-i", "-f", str(self.conf_file)], env=self.env())
            started.append("slurmctld")
        for node in self.cfg.node_names:
            proc = self.slurmd(node)
            if proc.pid() is None:
                proc.start([slurmd, "-D", "-f", str(self.conf_file), "-N", node], env=self.env())
                started.append(f"slurmd {node}")
        return started

    def _check_prolog(self) -> None:
        """A configured prolog must be there and executable: slurmd would fail every job's prolog
        (draining each node) and say why only in its log."""
        path = self.cfg.prolog
        if path and not (os.path.isfile(path) and os.access(path, os.X_OK)):
            why = "is not executable" if os.path.isfile(path) else "does not exist"
            raise StackError(f"stack.slurm_prolog: {path} {why}")

    def _ensure_key(self) -> None:
        """A private munge key in the home: copied from the package's when readable, else random."""
        if self.key_file.exists():
            return
        system = Path("/etc/munge/munge.key")
        try:
            data = system.read_bytes()
        except OSError:
            data = os.urandom(1024)  # munge keys are opaque bytes; 1 KiB as mungekey makes them
        fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    def wait_idle(self, timeout_s: float) -> float:
        """Wait until every node has registered and answers: idle, or taken by what an earlier run
        left (an allocation, a drain: an operator's business, not a failed start); returns the
        seconds waited."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        last: dict[str, str] = {}
        while time.monotonic() < deadline:
            for proc in (self.munged, self.ctld, *map(self.slurmd, self.cfg.node_names)):
                if proc.exited_early():
                    raise StackError(
                        f"{proc.name} exited during start-up; see {self._log_of(proc)}; last log lines:\n"
                        f"{self._tail(proc)}"
                    )
            try:
                last = {n["name"]: n["state"] for n in self.nodes()}
            except StackError:
                last = {}
            if len(last) == self.cfg.nodes and all(_up(s) for s in last.values()):
                return time.monotonic() - t0
            time.sleep(0.5)
        not_idle = {n: s for n, s in last.items() if not _up(s)} or "no answer from slurmctld"
        raise StackError(
            f"Slurm nodes not idle after {timeout_s:.0f}s ({not_idle}); see {self.dir / 'log'}/slurmctld.log "
            f"and slurmd-nX.log; slurmctld's last log lines:\n{self._tail(self.ctld)}"
        )

    def _log_of(self, proc: ManagedProcess) -> Path:
        if proc is self.munged:
            return self.dir / "log" / "munged.log"
        if proc is self.ctld:
            return self.dir / "log" / "slurmctld.log"
        return self.dir / "log" / f"slurmd-{proc.name.split()[-1]}.log"

    def _tail(self, proc: ManagedProcess, lines: int = 15) -> str:
        # The daemons' own log files say more than their (mostly empty) stdout.
        try:
            text = self._log_of(proc).read_text(errors="replace")
        except OSError:
            return proc.log_tail(lines)
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> list[str]:
        """Stop this home's slurmd, slurmctld and munged (in that order); returns those stopped."""
        stopped = []
        nodes = [p.stem.removeprefix("slurmd-") for p in (self.dir / "pids").glob("slurmd-*.pid")]
        for node in sorted(nodes, key=_node_order):
            proc = self.slurmd(node)
            if proc.stop(timeout_s=20):
                stopped.append(proc.name)
        if self.ctld.stop(timeout_s=20):
            stopped.append("slurmctld")
        if self.munged.stop(timeout_s=10):
            stopped.append("munged")
        return stopped

    # -- inspection -------------------------------------------------------------------------
    def run(self, *argv: str, timeout_s: float = 15.0) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster."""
        try:
            return subprocess.run(
                list(argv), capture_output=True, text=True, env=self.env(), timeout=timeout_s
            )
        except FileNotFoundError as exc:
            raise StackError(f"{argv[0]} not installed: run scripts/setup.sh") from exc
        except subprocess.TimeoutExpired as exc:
            raise StackError(f"{' '.join(argv)} did not answer in {timeout_s:.0f}s") from exc

    def nodes(self) -> list[dict[str, str]]:
        """Each node's name, state (long form, e.g. ``idle``, ``drained``, ``mixed``) and reason."""
        # One line per node, fields split by a character no Slurm field contains.
        res = self.run("sinfo", "--noheader", "--Node", "--format=%N\x1f%T\x1f%E", timeout_s=10)
        if res.returncode != 0:
            raise StackError(f"sinfo failed (exit {res.returncode}): {res.stderr.strip()}")
        nodes: dict[str, dict[str, str]] = {}
        for line in res.stdout.splitlines():
            parts = line.split("\x1f")
            if len(parts) != 3:
                continue
            name, state, reason = (p.strip() for p in parts)
            # A node in two partitions is listed twice; one entry each.
            nodes[name] = {"name": name, "state": state, "reason": "" if reason == "none" else reason}
        return sorted(nodes.values(), key=lambda n: _node_order(n["name"]))

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "conf": str(self.conf_file),
            "munge_socket": str(self.munge_socket),
            "running": self.running(),
            "pids": {
                "munged": self.munged.pid(),
                "slurmctld": self.ctld.pid(),
                "slurmd": {
                    node: self.slurmd(node).pid()
                    for node in sorted(
                        (p.stem.removeprefix("slurmd-") for p in (self.dir / "pids").glob("slurmd-*.pid")),
                        key=_node_order,
                    )
                },
            },
            "nodes": [],
            "healthy": False,
        }
        if out["running"]:
            try:
                out["nodes"] = self.nodes()
            except StackError as exc:
                out["error"] = str(exc)
            states = [n["state"] for n in out["nodes"]]
            # Healthy: slurmctld answers and no node is down; a drained node is an operator's (or
            # TrainGuard's) decision, not a fault of the cluster.
            out["healthy"] = bool(states) and not any(s.startswith(("down", "unknown")) for s in states)
        return out


def _node_order(name: str) -> int:
    """n2 before n10."""
    return int(name[1:]) if name[1:].isdigit() else 0
