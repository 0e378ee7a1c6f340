"""Ranks found without configuration: a launcher registers its rank on the reporter socket, and the
process source follows that process and its children (no ``pids``, ``cgroup`` or ``cmd_pattern``).

The processes are real: this test plays the launcher (it starts the rank, so the rank is its
child, and its datagrams carry its kernel-verified pid), the rank starts a DataLoader-like
worker (``pt_data_worker``, as torch names them), and both are killed for real.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.exporter.conftest import make_cfg
from tests.waiting import wait_until
from trainguard.infra.proctable import ProcStat
from trainguard.schemas.base import EVENT_TYPES, LOCAL_TYPES, Event, register, register_local
from trainguard.schemas.codec import DecodeError, decode, encode
from trainguard.schemas.enums import ProcessRole
from trainguard.schemas.workload import ProcessExit, RankLiveness, RankRegistration
from trainguard.streams.exporter.ranks import RankRegistry
from trainguard.streams.exporter.runner import Exporter
from trainguard.streams.exporter.sources.base import SourceContext
from trainguard.streams.exporter.sources.process import ProcessSource
from trainguard.streams.exporter.sources.reporter import ReporterSource

#: the rank's DataLoader worker: renames itself as torch's workers do, says so, and waits.
WORKER = textwrap.dedent(
    """
    import pathlib, sys, time
    pathlib.Path("/proc/self/comm").write_text("pt_data_worker")
    pathlib.Path(sys.argv[1]).write_text("ready")
    time.sleep(120)
    """
)
#: the rank: starts its worker, writes the worker's pid to argv[1] once it runs, and waits.
RANK = textwrap.dedent(
    f"""
    WORKER = {WORKER!r}
    import pathlib, subprocess, sys, time
    out = pathlib.Path(sys.argv[1])
    ready = pathlib.Path(sys.argv[1] + ".worker")
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(ready)])
    while not ready.exists():
        time.sleep(0.01)
    out.write_text(str(worker.pid))
    time.sleep(120)
    """
)


@dataclass
class Node:
    """A reporter source and a process source of one exporter, sharing its rank registry."""

    ctx: SourceContext
    reporter: ReporterSource
    process: ProcessSource

    def register(self, pid: int, rank: int = 3, job: str = "llm", launcher_pid: int | None = None) -> None:
        """Send a registration from this process (the launcher) and wait until it is filed."""
        reg = RankRegistration(
            job=job,
            node="n2",
            rank=rank,
            local_rank=1,
            pid=pid,
            launcher_pid=os.getpid() if launcher_pid is None else launcher_pid,
            ts_ms=1_700_000_000_000,
        )
        before = self.reporter.rejected
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(encode(reg), str(self.reporter.path))

        def filed() -> bool:
            assert self.reporter.collect() == []  # a registration is filed, never published
            return len(self.ctx.ranks) > 0 or self.reporter.rejected > before

        wait_until(filed, 10, "the registration filed", interval_s=0.01)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    """An exporter with no job and no process selection, reading this machine's real /proc."""
    cfg = make_cfg(Path("/"), tmp_path, job="", process={"cmd_pattern": ""})
    ctx = SourceContext(cfg)
    n = Node(ctx, ReporterSource(ctx), ProcessSource(ctx))
    n.reporter.collect()  # binds the socket
    yield n
    n.reporter.close()


@pytest.fixture
def rank(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A rank process (this process's child) and its DataLoader worker's pid, once both run."""
    out = tmp_path / "worker.pid"
    proc = subprocess.Popen([sys.executable, "-c", RANK, str(out)])
    try:
        worker = int(wait_until(lambda: out.exists() and out.read_text(), 30, "the rank's worker started"))
        yield proc, worker
    finally:
        proc.kill()
        proc.wait()


def _of(events: list[Event], cls: type) -> list:
    return [e for e in events if isinstance(e, cls)]


def test_a_registered_rank_and_its_worker_are_followed_until_they_die(
    node: Node, rank: tuple[subprocess.Popen[bytes], int]
) -> None:
    proc, worker = rank
    assert _of(node.process.collect(), RankLiveness) == []  # no job, nothing selected: nothing seen
    node.register(proc.pid)
    tracked = {p.pid: p for p in node.process.snapshot()}
    assert (tracked[proc.pid].role, tracked[proc.pid].rank, tracked[proc.pid].job) == (
        ProcessRole.MAIN,
        3,
        "llm",
    )
    assert (tracked[worker].role, tracked[worker].rank, tracked[worker].job) == (
        ProcessRole.DATALOADER,
        3,
        "llm",
    )
    (live,) = _of(node.process.collect(), RankLiveness)
    assert (live.job, live.node, live.ranks) == ("llm", "node-t", [3])

    # The worker is killed: its parent has not reaped it, so its exit status is read (a zombie).
    os.kill(worker, signal.SIGKILL)

    def worker_exit() -> list[ProcessExit]:
        return [e for e in _of(node.process.collect(), ProcessExit) if e.pid == worker]

    (gone,) = wait_until(worker_exit, 10, "the worker's exit")
    assert (gone.job, gone.rank, gone.role, gone.signal) == ("llm", 3, ProcessRole.DATALOADER, 9)

    # The rank dies and is reaped: its registration is dropped, its end reported, and its job's
    # liveness goes on with no rank (the node is up, the job no longer runs here).
    proc.kill()
    proc.wait()
    events = node.process.collect()
    (main,) = [e for e in _of(events, ProcessExit) if e.pid == proc.pid]
    assert (main.job, main.rank, main.role, main.exit_code) == ("llm", 3, ProcessRole.MAIN, None)
    assert len(node.ctx.ranks) == 0
    (live,) = _of(events, RankLiveness)
    assert (live.job, live.ranks) == ("llm", [])


def test_only_the_senders_own_child_is_followed(
    node: Node, rank: tuple[subprocess.Popen[bytes], int]
) -> None:
    _, worker = rank  # the rank's child: not this process's
    node.register(worker)
    assert len(node.ctx.ranks) == 1
    assert node.process.snapshot() == []
    assert len(node.ctx.ranks) == 0  # not the sender's child: dropped, never followed


def test_registrations_can_be_turned_off_and_selection_by_config_still_works(
    tmp_path: Path, rank: tuple[subprocess.Popen[bytes], int]
) -> None:
    proc, worker = rank
    cfg = make_cfg(Path("/"), tmp_path, job="", process={"cmd_pattern": "", "registered": False})
    ctx = SourceContext(cfg)
    n = Node(ctx, ReporterSource(ctx), ProcessSource(ctx))
    n.reporter.collect()
    try:
        n.register(proc.pid)
        assert n.process.snapshot() == []
        by_pid = make_cfg(Path("/"), tmp_path, job="", process={"pids": [proc.pid], "registered": False})
        tracked = ProcessSource(SourceContext(by_pid)).snapshot()
        assert {p.pid for p in tracked} == {proc.pid, worker}
        assert {p.job for p in tracked} == {""}  # selected by config: the exporter's job
    finally:
        n.reporter.close()


def test_a_registration_for_another_job_than_the_exporters_is_refused(
    tmp_path: Path, rank: tuple[subprocess.Popen[bytes], int]
) -> None:
    proc, _ = rank
    cfg = make_cfg(Path("/"), tmp_path, job="job-t", process={"cmd_pattern": ""})
    ctx = SourceContext(cfg)
    n = Node(ctx, ReporterSource(ctx), ProcessSource(ctx))
    n.reporter.collect()
    try:
        n.register(proc.pid, job="other")
        assert n.reporter.rejected_by["job"] == 1 and len(ctx.ranks) == 0
        n.register(proc.pid, job="job-t")
        (live,) = _of(n.process.collect(), RankLiveness)
        assert (live.job, live.ranks) == ("job-t", [3])
    finally:
        n.reporter.close()


def test_the_exporters_sources_and_captures_share_one_registry(tmp_path: Path) -> None:
    cfg = make_cfg(Path("/"), tmp_path, job="", process={"cmd_pattern": ""})
    ex = Exporter(cfg, lambda e: None, once=True)
    try:
        reporter, process = ex.sources["reporter"], ex.sources["process"]
        assert isinstance(reporter, ReporterSource) and isinstance(process, ProcessSource)
        assert reporter.ctx.ranks is process.ctx.ranks is ex.ranks
        assert (ex.ranks.max_ranks, ex.ranks.linger_s) == (4096, 3600.0)
    finally:
        ex.stop()


def test_a_registry_handed_over_empty_is_the_one_used(tmp_path: Path) -> None:
    """The service hands its (still empty, so falsy) registry to the exporter and gives the same one
    to its stack and Flight Recorder captures: the exporter must keep it, or the captures follow no
    rank at all (measured: every capture of a SIGSTOPped rank's job waited for its deadline)."""
    cfg = make_cfg(Path("/"), tmp_path, job="", process={"cmd_pattern": ""})
    mine = RankRegistry(16, 60.0)
    assert len(mine) == 0
    ex = Exporter(cfg, lambda e: None, once=True, ranks=mine)
    try:
        process = ex.sources["process"]
        assert isinstance(process, ProcessSource)
        assert ex.ranks is mine and process.ctx.ranks is mine
    finally:
        ex.stop()


# -- the registry, on a process table given by hand --------------------------------------------------


def _reg(pid: int, launcher_pid: int, rank: int = 0, job: str = "j") -> RankRegistration:
    return RankRegistration(
        job=job, node="n", rank=rank, local_rank=rank, pid=pid, launcher_pid=launcher_pid, ts_ms=1
    )


def _stats(*parent_child: tuple[int, int]) -> dict[int, ProcStat]:
    out = {}
    for ppid, pid in parent_child:
        out.setdefault(ppid, ProcStat(ppid, "launch", "S", 1, 1))
        out[pid] = ProcStat(pid, "python", "R", ppid, 2)
    return out


def test_a_registration_filed_after_the_process_list_was_read_is_kept() -> None:
    now = [10.0]
    r = RankRegistry(clock=lambda: now[0])
    assert r.add(_reg(20, 10), sender_pid=10)
    assert r.resolve({}, taken_at=9.0) == {} and len(r) == 1  # that list could not hold it yet
    assert r.resolve({}, taken_at=11.0) == {} and len(r) == 0  # this one could: gone


def test_sending_again_keeps_the_first_filing_and_another_rank_replaces_it() -> None:
    now = [10.0]
    r = RankRegistry(clock=lambda: now[0])
    assert r.add(_reg(20, 10, rank=3), sender_pid=10)
    now[0] = 50.0
    assert r.add(_reg(20, 10, rank=3), sender_pid=10)
    # Still filed at 10, not 50: a process list read at 20 without the rank says it is gone.
    assert r.resolve({}, taken_at=20.0) == {} and len(r) == 0
    assert r.add(_reg(20, 10, rank=3), sender_pid=10)
    now[0] = 55.0
    assert r.add(_reg(21, 10, rank=5), sender_pid=10)  # a new launcher with the old one's pid
    ((pid, entry),) = r.resolve(_stats((10, 21)), taken_at=60.0).items()
    assert (pid, entry.rank, len(r)) == (21, 5, 1)


def test_a_launcher_in_another_pid_namespace_names_its_only_child() -> None:
    r = RankRegistry()
    # Seen as 5 / 6 inside its container, as 1000 / 1001 here.
    assert r.add(_reg(6, 5, rank=2), sender_pid=1000)
    ((pid, entry),) = r.resolve(_stats((1000, 1001)), taken_at=r.clock()).items()
    assert (pid, entry.rank, entry.launcher_pid, entry.same_ns) == (1001, 2, 1000, False)
    # Two children: which one is the rank cannot be told, so none is followed.
    assert r.resolve(_stats((1000, 1001), (1000, 1002)), taken_at=r.clock()) == {}


def test_invisible_senders_and_a_full_registry_are_refused() -> None:
    r = RankRegistry(max_ranks=1)
    assert not r.add(_reg(20, 10), sender_pid=0)
    assert r.add(_reg(20, 10), sender_pid=10)
    assert not r.add(_reg(30, 11), sender_pid=11)
    assert r.add(_reg(20, 10), sender_pid=10)  # the one registered may say it again


def test_a_jobs_liveness_lingers_after_its_last_rank() -> None:
    now = [0.0]
    r = RankRegistry(linger_s=30.0, clock=lambda: now[0])
    r.add(_reg(20, 10, job="a"), sender_pid=10)
    assert r.jobs() == ["a"]
    now[0] = 5.0
    r.resolve({}, taken_at=5.0)  # the rank is gone
    now[0] = 30.0
    assert r.jobs() == ["a"]
    now[0] = 31.0
    assert r.jobs() == []


# -- the message -------------------------------------------------------------------------------------


def test_the_registration_is_node_local_read_only_where_asked() -> None:
    reg = _reg(4711, 4700, rank=3)
    raw = encode(reg)
    assert decode(raw, local=True) == reg
    with pytest.raises(DecodeError, match="'rank_registration' is a node-local event, not read here"):
        decode(raw)  # a topic's consumer never reads it
    assert LOCAL_TYPES["rank_registration"] is RankRegistration
    assert "rank_registration" not in EVENT_TYPES  # no topic, no table
    with pytest.raises(DecodeError, match=r"rank_registration.pid: -1 is below the minimum 0"):
        decode(raw.replace(b'"pid":4711', b'"pid":-1'), local=True)


def test_a_wire_name_means_one_thing() -> None:
    class Clash(Event):
        TYPE = "rank_registration"

    with pytest.raises(TypeError, match="registered twice"):
        register(Clash)
    with pytest.raises(TypeError, match="registered twice"):
        register_local(Clash)
