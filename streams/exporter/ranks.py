"""The ranks their launchers registered with this node's exporter: training processes found with no
process selection configured (``process.pids``, ``cgroup``, ``cmd_pattern``).

``trainguard launch`` sends a :class:`~trainguard.schemas.workload.RankRegistration` for the rank it
started to the reporter socket, and again every few seconds (an exporter started after the
launcher, or restarted, learns the rank within one interval).  The reporter source files it here
under the sender's kernel-verified pid; the process source, stack captures and Flight Recorder
dumps read it back through :meth:`RankRegistry.resolve`, which keeps a registration only while
its process is a child of that sender -- a launcher can name its own child, never another
process (the exporter runs py-spy on what it follows) -- and drops it once the process is gone.

A job learnt from registrations keeps its liveness going for ``linger_s`` after its last rank
here is gone (an empty rank list: the node is up, the job is not running on it).  Stopping at
once would leave the node's last word listing ranks, which the worker reads as a silent machine.

>>> from trainguard.infra.proctable import ProcStat
>>> from trainguard.schemas.workload import RankRegistration
>>> reg = RankRegistration(job="j", node="n1", rank=3, local_rank=1, pid=20, launcher_pid=10, ts_ms=1)
>>> r = RankRegistry(clock=lambda: 0.0)
>>> r.add(reg, sender_pid=10)
True
>>> stats = {10: ProcStat(10, "trainguard", "S", 1, 5), 20: ProcStat(20, "python", "R", 10, 6)}
>>> [(p, x.rank, x.job) for p, x in r.resolve(stats, taken_at=1.0).items()]
[(20, 3, 'j')]
>>> r.resolve({10: stats[10]}, taken_at=2.0), len(r)  # the rank's process is gone: dropped
({}, 0)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from trainguard.infra.proctable import ProcStat
from trainguard.schemas.workload import RankRegistration

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegisteredRank:
    """One registration, with the launcher's pid as this exporter sees it."""

    job: str
    rank: int
    local_rank: int
    #: the rank's main process: in this exporter's pid namespace when ``same_ns``, else the
    #: launcher's (a launcher in a container); then the rank is the launcher's only child here.
    pid: int
    launcher_pid: int
    same_ns: bool
    #: when it was filed (the registry's clock): a process list read before then may lack it.
    filed_at: float


class RankRegistry:
    """Registrations by launcher (one rank per launcher), thread-safe: the reporter's receiver adds,
    the process source and the capture threads resolve."""

    def __init__(
        self, max_ranks: int = 4096, linger_s: float = 3600.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_ranks = max_ranks
        self.linger_s = linger_s
        self.clock = clock
        self._lock = threading.Lock()
        self._by_launcher: dict[int, RegisteredRank] = {}
        #: job -> when a rank of it was last registered here (the clock's time).
        self._jobs: dict[str, float] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_launcher)

    def add(self, reg: RankRegistration, sender_pid: int) -> bool:
        """File ``reg``, sent by ``sender_pid`` (kernel-verified, this exporter's view; 0: not
        visible here).  False: refused -- an invisible sender, or ``max_ranks`` other launchers."""
        if sender_pid <= 0:
            return False
        entry = RegisteredRank(
            job=reg.job,
            rank=reg.rank,
            local_rank=reg.local_rank,
            pid=reg.pid,
            launcher_pid=sender_pid,
            same_ns=reg.launcher_pid == sender_pid,
            filed_at=self.clock(),
        )
        with self._lock:
            old = self._by_launcher.get(sender_pid)
            if old is None and len(self._by_launcher) >= self.max_ranks:
                return False
            # A re-sent registration keeps its filing time: it is the same rank, already seen.
            same = old is not None and (old.job, old.rank, old.pid) == (entry.job, entry.rank, entry.pid)
            self._by_launcher[sender_pid] = old if same and old is not None else entry
            self._jobs[entry.job] = entry.filed_at
        if not same:
            log.info(
                "rank %d of job %s registered by its launcher (pid %d, launcher pid %d)",
                reg.rank,
                reg.job,
                reg.pid,
                sender_pid,
            )
        return True

    def resolve(self, stats: Mapping[int, ProcStat], taken_at: float) -> dict[int, RegisteredRank]:
        """pid -> registration of every registered rank whose process is in ``stats`` (the process
        list read at ``taken_at``, the registry's clock) as its launcher's child.  The others are
        dropped, except those filed after ``taken_at``: that list could not hold them yet."""
        children: dict[int, list[int]] = {}
        for st in stats.values():
            children.setdefault(st.ppid, []).append(st.pid)
        out: dict[int, RegisteredRank] = {}
        gone: list[RegisteredRank] = []
        with self._lock:
            for launcher, entry in list(self._by_launcher.items()):
                pid = _pid_of(entry, stats, children.get(launcher, []))
                if pid is not None:
                    out[pid] = entry
                    self._jobs[entry.job] = max(self._jobs.get(entry.job, 0.0), taken_at)
                elif entry.filed_at <= taken_at:
                    del self._by_launcher[launcher]
                    gone.append(entry)
        for entry in gone:
            log.info(
                "rank %d of job %s: process %d gone (launcher pid %d); registration dropped",
                entry.rank,
                entry.job,
                entry.pid,
                entry.launcher_pid,
            )
        return out

    def jobs(self) -> list[str]:
        """The jobs with a rank registered here now or within ``linger_s``, sorted."""
        now = self.clock()
        with self._lock:
            live = {e.job for e in self._by_launcher.values()}
            self._jobs = {j: t for j, t in self._jobs.items() if j in live or now - t <= self.linger_s}
            return sorted(self._jobs)


def _pid_of(entry: RegisteredRank, stats: Mapping[int, ProcStat], children: list[int]) -> int | None:
    """The registered rank's pid in ``stats``, if it is there as its launcher's child."""
    if entry.same_ns:
        st = stats.get(entry.pid)
        return entry.pid if st is not None and st.ppid == entry.launcher_pid else None
    # Another pid namespace: the launcher starts one child, so its only child here is the rank.
    return children[0] if len(children) == 1 else None
