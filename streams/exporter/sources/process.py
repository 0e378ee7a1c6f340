"""``process`` source: the job's training processes on this node, their process trees, and their
exits.

Training processes are the ranks their launchers registered (``trainguard launch``: no
configuration needed; :mod:`trainguard.streams.exporter.ranks`) and those selected by config (pids,
a cgroup, or a command-line pattern); their trees take in every descendant, so dataloader workers
(torch names them ``pt_data_worker``) and checkpoint writers are found too -- the paper's
process-tree step of stack aggregation (§5).  A registered process carries its registration's
rank and job, and its descendants inherit them.
When a tracked process ends, a :class:`~trainguard.schemas.workload.ProcessExit` is published: with the
exit code or signal when the process was seen as a zombie (``/proc/PID/stat`` field 52 holds its
wait status), otherwise with the reason alone (a non-parent cannot wait() for it; the reporter
inside the process reports its own exit reason).  The same discovery serves stack capture.
Processes are read through :class:`trainguard.infra.proctable.ProcTable` on the configured root's ``proc``.

Every round also publishes a :class:`~trainguard.schemas.workload.RankLiveness` for the configured
job and for each job learnt from registrations: the ranks alive on this node (none, when the job
does not run here) and their states, keyed by job, so the worker judging the job's progress knows
which machines still speak -- a frozen or lost machine sends neither steps nor liveness, and is
found long before a collective timeout.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from trainguard.infra.proctable import ProcStat, ProcTable
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.enums import ProcessRole
from trainguard.schemas.workload import ProcessExit, ProcessInfo, RankLiveness
from trainguard.streams.exporter.config import ProcessConfig
from trainguard.streams.exporter.ranks import RankRegistry, RegisteredRank
from trainguard.streams.exporter.sources.base import SourceContext, read_text, register

log = logging.getLogger(__name__)

#: torch.utils.data worker processes set their name to this (torch/utils/data/_utils/worker.py).
DATALOADER_COMM = "pt_data_worker"


def decode_wait_status(status: int) -> tuple[int | None, int | None]:
    """(exit code, signal) of a wait status.

    >>> decode_wait_status(256), decode_wait_status(9), decode_wait_status(0x8b)
    ((1, None), (None, 9), (None, 11))
    """
    if status & 0x7F == 0:
        return (status >> 8) & 0xFF, None
    return None, status & 0x7F


@dataclass(frozen=True)
class TrackedProcess:
    """One process of a training process tree, with its role, rank (-1 if unknown) and job ("" if
    selected by config: the exporter's job)."""

    pid: int
    ppid: int
    starttime: int
    comm: str
    state: str
    cmdline: str
    role: ProcessRole
    rank: int
    exit_status: int | None = None
    job: str = ""

    @property
    def key(self) -> tuple[int, int]:
        # (pid, start time): a recycled pid is another process.
        return (self.pid, self.starttime)

    def info(self) -> ProcessInfo:
        return ProcessInfo(
            pid=self.pid, ppid=self.ppid, role=self.role, cmdline=self.cmdline[:8192], state=self.state
        )


def rank_of(table: ProcTable, pid: int, env_name: str) -> int | None:
    """The rank from the process's environment (``RANK``), else from a ``--rank N`` argument."""
    value = (table.environ(pid) or {}).get(env_name)
    if value is None:
        argv = table.cmdline(pid).split()  # a renamed process has one space-separated title
        if "--rank" in argv[:-1]:
            value = argv[argv.index("--rank") + 1]
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def select_pids(
    cfg: ProcessConfig, table: ProcTable, cgroup_root: Path, stats: dict[int, ProcStat]
) -> set[int]:
    """The pids the config names: explicit pids, a cgroup's members, command-line matches."""
    chosen = {p for p in cfg.pids if p in stats}
    if cfg.cgroup:
        try:
            text = read_text(cgroup_root / cfg.cgroup.strip("/") / "cgroup.procs")
            chosen |= {int(p) for p in text.split() if p.isdigit() and int(p) in stats}
        except OSError as exc:
            log.warning("cgroup %s: %s", cfg.cgroup, exc)
    if cfg.cmd_pattern:
        pattern = re.compile(cfg.cmd_pattern)
        me = os.getpid()
        for pid in stats:
            if pid != me and pattern.search(table.cmdline(pid)):
                chosen.add(pid)
    return chosen


def build_tree(
    cfg: ProcessConfig,
    table: ProcTable,
    stats: dict[int, ProcStat],
    selected: set[int],
    registered: Mapping[int, RegisteredRank] | None = None,
) -> list[TrackedProcess]:
    """Selected roots (no selected ancestor) and all their descendants, with roles and ranks; a
    ``registered`` process (selected too) has its registration's rank and job."""
    registered = registered or {}
    children: dict[int, list[int]] = {}
    for st in stats.values():
        children.setdefault(st.ppid, []).append(st.pid)

    def has_selected_ancestor(pid: int) -> bool:
        seen, cur = set(), stats[pid].ppid
        while cur in stats and cur not in seen:
            if cur in selected:
                return True
            seen.add(cur)
            cur = stats[cur].ppid
        return False

    ckpt = re.compile(cfg.checkpoint_pattern) if cfg.checkpoint_pattern else None
    out: list[TrackedProcess] = []
    stack: list[tuple[int, int | None, str]] = [
        (p, None, "") for p in sorted(selected) if not has_selected_ancestor(p)
    ]
    while stack:
        pid, parent_rank, job = stack.pop(0)
        st = stats[pid]
        cmdline = table.cmdline(pid)
        reg = registered.get(pid)
        own = reg.rank if reg is not None else rank_of(table, pid, cfg.rank_env)
        job = reg.job if reg is not None else job
        rank = own if own is not None else parent_rank
        if st.comm == DATALOADER_COMM:
            role = ProcessRole.DATALOADER
        elif ckpt is not None and parent_rank is not None and (ckpt.search(st.comm) or ckpt.search(cmdline)):
            role = ProcessRole.CHECKPOINT
        elif own is not None and own != parent_rank:
            role = ProcessRole.MAIN
        else:
            role = ProcessRole.OTHER
        out.append(
            TrackedProcess(
                pid=pid,
                ppid=st.ppid,
                starttime=st.starttime,
                comm=st.comm,
                state=st.state,
                cmdline=cmdline,
                role=role,
                rank=-1 if rank is None else rank,
                exit_status=st.exit_status,
                job=job,
            )
        )
        stack.extend((c, rank, job) for c in sorted(children.get(pid, [])))
    return out


def discover(
    cfg: ProcessConfig, proc: Path, cgroup_root: Path, ranks: RankRegistry | None = None
) -> list[TrackedProcess]:
    """The job's process trees on this node right now (``proc``: the procfs directory), with the
    ranks registered in ``ranks`` (when ``cfg.registered``)."""
    table = ProcTable(proc)
    follow = ranks if ranks is not None and cfg.registered else None
    taken_at = follow.clock() if follow is not None else 0.0
    stats = table.stats()
    registered = follow.resolve(stats, taken_at) if follow is not None else {}
    selected = select_pids(cfg, table, cgroup_root, stats) | set(registered)
    return build_tree(cfg, table, stats, selected, registered)


class ProcessSource:
    name = "process"

    def __init__(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg.process
        self.proc = ctx.cfg.sys_path("/proc")
        self.cgroup_root = ctx.cfg.sys_path("/sys/fs/cgroup")
        self.known: dict[tuple[int, int], TrackedProcess] = {}
        self.reported: set[tuple[int, int]] = set()
        #: job -> the sequence number of its last liveness.
        self.seq: dict[str, int] = {}

    def snapshot(self) -> list[TrackedProcess]:
        return discover(self.cfg, self.proc, self.cgroup_root, self.ctx.ranks)

    def _exit(self, p: TrackedProcess, reason: str) -> ProcessExit:
        code = sig = None
        if p.exit_status is not None:
            code, sig = decode_wait_status(p.exit_status)
            reason = f"killed by signal {sig}" if sig else f"exited with code {code}"
        return ProcessExit(
            node=self.ctx.node,
            ts_ms=now_ms(),
            pid=p.pid,
            job=p.job or self.ctx.job,
            rank=p.rank,
            role=p.role,
            exit_code=code,
            signal=sig,
            reason=reason,
        )

    def collect(self) -> list[Event]:
        current = {p.key: p for p in self.snapshot()}
        events: list[Event] = []
        for key, p in current.items():
            if p.state == "Z" and key not in self.reported:
                events.append(self._exit(p, "zombie"))
                self.reported.add(key)
        for key, p in self.known.items():
            if key not in current and key not in self.reported:
                events.append(self._exit(p, "process ended (exit status not visible to a non-parent)"))
        self.reported &= set(current)  # forget reaped zombies
        self.known = current
        procs = list(current.values())
        jobs = [self.ctx.job] if self.ctx.job else []
        if self.cfg.registered:
            jobs += [j for j in self.ctx.ranks.jobs() if j and j != self.ctx.job]
        events.extend(self._liveness(job, procs) for job in jobs)
        return events

    def _liveness(self, job: str, procs: list[TrackedProcess]) -> RankLiveness:
        """The ranks of ``job`` whose main process lives here (a zombie is dead).  Sent with no
        rank too: the node is up while the job is stopped or runs elsewhere, which keeps a
        recovery's restart (ranks gone a while) from looking like a silent machine."""
        mains = {
            p.rank: p.state
            for p in procs
            if p.role is ProcessRole.MAIN
            and p.rank >= 0
            and p.state not in "ZX"
            and (p.job or self.ctx.job) == job
        }
        self.seq[job] = self.seq.get(job, 0) + 1
        ranks = sorted(mains)
        return RankLiveness(
            job=job,
            node=self.ctx.node,
            ts_ms=now_ms(),
            ranks=ranks,
            states=[mains[r][:4] for r in ranks],
            interval_s=max(0.05, self.cfg.interval_s),
            seq=self.seq[job],
        )

    def close(self) -> None:
        pass


@register("process")
def _factory(ctx: SourceContext) -> ProcessSource:
    return ProcessSource(ctx)
