"""The agent's ranks as the node exporter hears of them: what ``trainguard launch`` sends for its
child, on the same reporter socket (Unix datagrams; never waited for, never fatal).

Each forked rank is registered (``RankRegistration``: job, node, rank, local rank, its pid, the
agent's pid) at once and again every ``register_interval_s``, so the exporter follows it (stack
captures, exits) also when it starts after the agent.  A rank that ends on its own is reported
(``ProcessExit``: the exporter cannot read the status of a process it did not start); a rank the
agent stopped for a restart is not -- that exit is the recovery, not a fault.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from trainguard.commands.launch import ExporterLink, exit_event
from trainguard.schemas.base import now_ms
from trainguard.schemas.workload import RankRegistration


class RankReports:
    def __init__(self, socket_path: str, job: str, node: str) -> None:
        self.link = ExporterLink(socket_path)
        self.job, self.node = job, node

    def register(self, rank: int, local_rank: int, pid: int) -> bool:
        return self.link.send(
            RankRegistration(
                job=self.job,
                node=self.node,
                rank=rank,
                local_rank=local_rank,
                pid=pid,
                launcher_pid=os.getpid(),
                ts_ms=now_ms(),
            )
        )

    def exited(self, rank: int, pid: int, returncode: int) -> bool:
        who = SimpleNamespace(job=self.job, node=self.node, rank=rank)
        return self.link.send(exit_event(who, pid, returncode, now_ms()))  # type: ignore[arg-type]

    def close(self) -> None:
        self.link.close()
