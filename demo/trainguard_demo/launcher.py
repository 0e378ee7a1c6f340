"""Start and stop a demo job's rank processes, per job or per machine, and its warm standbys.

.. code-block:: python

    spec = LaunchSpec(job="j", cluster_dir="/tmp/c", tp=2, pp=2, dp=2, ranks_per_machine=2, steps=50)
    with launch_job(spec) as h:      # 8 processes, one session (process group) each
        h.wait(timeout=120)          # {rank: exit code}; leaving the block stops them all

Each rank runs ``python -m trainguard_demo.trainer <spec.to_argv(rank)>`` in its **own session**
(so a machine's ranks are killed together with their DataLoader workers, and nothing else), with
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``TRAINGUARD_JOB``/``TRAINGUARD_NODE`` in its environment
and stdout/stderr appended to ``machines/<m>/logs/<job>/rank-R.out|.err``.  A machine replaced
by a standby: ``spec2 = spec.replace_machine("m2", "s0")``, ``launch_job(spec2,
machines=[others])`` and :func:`activate_standby` ``(spec2, "s0")``, which wakes a pool of warm
processes started by :func:`launch_standby` (see :mod:`.standby`).

CLI (runs a whole job in the foreground; Ctrl-C stops it): ``python -m trainguard_demo.launcher
--cluster-dir D --job J --tp 2 --pp 2 --dp 2 --ranks-per-machine 2 --steps 100``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from trainguard.infra.proctable import LIVE
from trainguard_demo.config import ClusterPaths, LaunchSpec, write_atomic


@dataclass
class RankProcess:
    """One started process: a rank (``rank >= 0``) or a standby slot (``rank == -1``)."""

    machine: str
    rank: int
    popen: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()


@dataclass
class JobHandle:
    """The processes :func:`launch_job` / :func:`launch_standby` started; stops them on ``__exit__``."""

    spec: LaunchSpec | None
    procs: list[RankProcess] = field(default_factory=list)

    def __enter__(self) -> JobHandle:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        stop_job(self, grace_s=2.0)

    def exit_codes(self) -> dict[int, int | None]:
        return {p.rank: p.poll() for p in self.procs}

    def wait(self, timeout: float) -> dict[int, int | None]:
        """Wait until every process exits or ``timeout`` passes; rank -> exit code (None: running)."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(max(0.0, deadline - time.monotonic()))
        return self.exit_codes()

    def progress(self) -> dict[int, dict[str, Any]]:
        """rank -> its latest progress record (missing ranks have not written one yet)."""
        assert self.spec is not None
        return read_progress(self.spec)


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **extra})
    # torch.cuda imports the deprecated pynvml on CPU hosts too: keep stderr for real errors.
    env.setdefault("PYTHONWARNINGS", "ignore:The pynvml package is deprecated:FutureWarning")
    return env


#: the niceness of every process this module starts (ranks, warm pools, zygotes), from the
#: environment so that every process that starts them -- the demo, the action service's executor,
#: the baseline's supervisor -- applies the same one (see :func:`cluster_nice`).
NICE_ENV = "TRAINGUARD_CLUSTER_NICE"


def cluster_nice() -> int:
    """The niceness the demo's cluster processes run at (``$TRAINGUARD_CLUSTER_NICE``, default 0).

    The demo puts a whole cluster and its control plane on one host; in a real one, Kafka,
    ClickHouse, the stream worker and the action service run on machines of their own and never
    wait for a training process's CPU.  A positive niceness for the simulated machines' processes
    restores that: on a busy 2-core host the control plane runs first, the training gets the rest.
    """
    try:
        return max(0, min(19, int(os.environ.get(NICE_ENV, "0"))))
    except ValueError:
        return 0


#: the CPUs every process this module starts may run on (``"0"``, ``"0-3"``, ``"0,2"``), read
#: like :data:`NICE_ENV`; a caller that runs a second cluster on the same host (the baseline)
#: passes its own set to :func:`launch_job` instead (see :func:`cluster_cpus`).
CPUS_ENV = "TRAINGUARD_CLUSTER_CPUS"


def parse_cpus(text: str) -> frozenset[int]:
    """The CPU numbers of a list like ``"0-3,6"`` (empty: no pinning).  Bad input is an error."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: expected numbers and ranges like '0-3,6'")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def cluster_cpus() -> frozenset[int]:
    """The CPUs the demo's cluster processes are pinned to (``$TRAINGUARD_CLUSTER_CPUS``; empty:
    not pinned).

    The demo runs two simulated clusters on one host -- TrainGuard's job and the baseline job --
    where a real site gives each job machines of its own.  Without pinning, the baseline's cold
    restarts (16 processes importing torch at once) take the CPU that TrainGuard's job needs to
    recover, so each job's result would depend on the other's timing.  Pinned to disjoint
    halves of the host, each job has "machines" of its own; the control plane is not pinned.
    """
    return parse_cpus(os.environ.get(CPUS_ENV, ""))


def _spawn(
    argv: list[str], out: Path, err: Path, env: dict[str, str], cpus: frozenset[int] | None = None
) -> subprocess.Popen[bytes]:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "ab") as fo, open(err, "ab") as fe:  # the child keeps its own descriptors
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, env=env, start_new_session=True
        )
    nice = cluster_nice()
    if nice:
        # Set from here, not in the child: no preexec_fn (unsafe with threads) and no code in
        # the trainer.  The child forks its DataLoader workers and pools later: they inherit it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.setpriority(os.PRIO_PROCESS, proc.pid, nice)
    cpus = cluster_cpus() if cpus is None else cpus
    if cpus:
        # Same as the niceness: set from here; the children (DataLoader workers, forked pools)
        # inherit it.  CPUs this host lacks are left out; none left: not pinned.
        usable = cpus & os.sched_getaffinity(0)
        if usable:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.sched_setaffinity(proc.pid, usable)
    return proc


def launch_job(
    spec: LaunchSpec,
    machines: Iterable[str] | None = None,
    python: str = sys.executable,
    cpus: frozenset[int] | None = None,
) -> JobHandle:
    """Start the ranks of ``spec`` on ``machines`` (default: all of the job's machines), pinned
    to ``cpus`` (default: :func:`cluster_cpus`)."""
    names = spec.machine_names()
    chosen = list(machines) if machines is not None else names
    unknown = set(chosen) - set(names)
    if unknown:
        raise ValueError(f"machines {sorted(unknown)} are not in job {spec.job!r}: {names}")
    paths = spec.paths()
    handle = JobHandle(spec)
    try:
        for machine in chosen:
            for rank in spec.ranks_on(machine):
                env = _env({
                    "RANK": str(rank), "WORLD_SIZE": str(spec.world_size),
                    "LOCAL_RANK": str(rank % spec.ranks_per_machine),
                    "TRAINGUARD_JOB": spec.job, "TRAINGUARD_NODE": machine,
                    # Each machine's ranks report through that machine's own exporter.
                    "TRAINGUARD_REPORTER_SOCKET": str(paths.machine(machine) / "reporter.sock"),
                })  # fmt: skip
                out, err = (paths.log(machine, spec.job, rank, s) for s in ("out", "err"))
                argv = [python, "-m", "trainguard_demo.trainer", *spec.to_argv(rank)]
                handle.procs.append(RankProcess(machine, rank, _spawn(argv, out, err, env, cpus), out, err))
    except BaseException:
        stop_job(handle, grace_s=0)
        raise
    return handle


def launch_standby(
    cluster_dir: str | os.PathLike[str],
    machine: str,
    slots: int,
    python: str = sys.executable,
    pool: str | None = None,
    warm_delay_s: float = 0.0,
) -> JobHandle:
    """Start a pool of ``slots`` warm processes on ``machine`` (a new pool id unless ``pool``)."""
    paths = ClusterPaths(Path(cluster_dir))
    pool = pool or f"{time.time_ns():x}"  # ordered by creation: the oldest ready pool is woken first
    paths.activation(machine, pool).unlink(missing_ok=True)
    handle = JobHandle(None)
    try:
        for slot in range(slots):
            logs = paths.machine(machine) / "logs" / "standby"
            out, err = (logs / f"{pool}-slot-{slot}.{s}" for s in ("out", "err"))
            argv = [python, "-m", "trainguard_demo.standby", "--cluster-dir", str(cluster_dir),
                    "--machine", machine, "--pool", pool, "--slot", str(slot),
                    "--warm-delay", repr(warm_delay_s)]  # fmt: skip
            env = _env(
                {
                    "TRAINGUARD_NODE": machine,
                    "TRAINGUARD_REPORTER_SOCKET": str(paths.machine(machine) / "reporter.sock"),
                }
            )
            handle.procs.append(RankProcess(machine, -1, _spawn(argv, out, err, env), out, err))
    except BaseException:
        stop_job(handle, grace_s=0)
        raise
    return handle


def start_zygote(
    cluster_dir: str | os.PathLike[str], machine: str, python: str = sys.executable
) -> JobHandle:
    """Start ``machine``'s zygote (:mod:`.zygote`), which forks warm pools on request."""
    paths = ClusterPaths(Path(cluster_dir))
    logs = paths.machine(machine) / "logs"
    argv = [python, "-m", "trainguard_demo.zygote", "--cluster-dir", str(cluster_dir), "--machine", machine]
    env = _env(
        {
            "TRAINGUARD_NODE": machine,
            "TRAINGUARD_REPORTER_SOCKET": str(paths.machine(machine) / "reporter.sock"),
        }
    )
    out, err = logs / "zygote.out", logs / "zygote.err"
    return JobHandle(None, [RankProcess(machine, -1, _spawn(argv, out, err, env), out, err)])


def new_pool(cluster_dir: str | os.PathLike[str], machine: str, slots: int, warm_delay_s: float = 0.0) -> str:
    """A new warm pool on ``machine``: forked by its zygote if it has one, else started cold."""
    from trainguard_demo.zygote import request_pool

    pool = request_pool(cluster_dir, machine, slots)
    if pool is None:
        pool = f"{time.time_ns():x}"
        launch_standby(cluster_dir, machine, slots, pool=pool, warm_delay_s=warm_delay_s)
    return pool


def ready_pools(cluster_dir: str | os.PathLike[str], machine: str, slots: int) -> list[str]:
    """Pools of ``machine`` whose ``slots`` processes are all waiting (oldest first)."""
    paths = ClusterPaths(Path(cluster_dir))
    try:
        pools = sorted(d.name for d in paths.pools(machine).iterdir() if d.is_dir())
    except FileNotFoundError:
        return []
    ready = []
    for pool in pools:
        if paths.activation(machine, pool).exists():
            continue
        try:
            status = [
                json.loads((paths.pool(machine, pool) / f"slot-{i}.json").read_text()) for i in range(slots)
            ]
        except (OSError, ValueError):
            continue
        if all(s.get("status") == "standby" and LIVE.alive(int(s.get("pid", 0))) for s in status):
            ready.append(pool)
    return ready


def standby_ready(cluster_dir: str | os.PathLike[str], machine: str, slots: int) -> bool:
    """True once a pool of ``slots`` processes on ``machine`` is waiting (torch imported)."""
    return bool(ready_pools(cluster_dir, machine, slots))


def activate_standby(spec: LaunchSpec, machine: str, pool: str | None = None) -> str:
    """Wake a ready pool of ``machine`` (default: the oldest) into ``spec``; returns the pool."""
    if machine not in spec.machine_names():
        raise ValueError(f"{machine!r} is not a machine of the job spec: {spec.machine_names()}")
    if pool is None:
        ready = ready_pools(spec.cluster_dir, machine, spec.ranks_per_machine)
        if not ready:
            raise RuntimeError(f"no warm pool of {spec.ranks_per_machine} processes is ready on {machine}")
        pool = ready[0]
    write_atomic(spec.paths().activation(machine, pool), spec.to_json())
    return pool


def _kill_group(p: RankProcess, sig: int) -> None:
    # The child leads its own session, so its pgid is its pid: only what we started is signalled.
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)


def stop_processes(procs: list[RankProcess], grace_s: float = 5.0) -> dict[int, int | None]:
    """SIGTERM the processes' groups, SIGKILL what is left after ``grace_s``; rank -> exit code."""
    for p in procs:
        _kill_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.popen.wait(max(0.0, deadline - time.monotonic()))
    for p in procs:
        _kill_group(p, signal.SIGKILL)
        # A dead leader can leave its DataLoader worker behind in the group; kill the group anyway.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        p.popen.wait()
    return {p.rank: p.poll() for p in procs}


def stop_job(handle: JobHandle, grace_s: float = 5.0) -> dict[int, int | None]:
    """Stop every process of the handle (and each one's process group)."""
    return stop_processes(handle.procs, grace_s)


def read_progress(spec: LaunchSpec) -> dict[int, dict[str, Any]]:
    out = {}
    for rank in range(spec.world_size):
        path = spec.paths().progress(spec.machine_of_rank(rank), spec.job, rank)
        with contextlib.suppress(FileNotFoundError, ValueError):
            out[rank] = json.loads(path.read_text())
    return out


def _print_tail(stream: TextIO, handle: JobHandle) -> None:
    for p in handle.procs:
        stream.write(f"rank {p.rank} ({p.machine}) exit {p.poll()}: logs {p.stdout} {p.stderr}\n")


def main(argv: list[str] | None = None) -> int:
    from trainguard_demo.trainer import build_parser, spec_from_args

    parser = build_parser()
    parser.prog = "python -m trainguard_demo.launcher"
    args = parser.parse_args(["--rank", "0", *(argv if argv is not None else sys.argv[1:])])
    spec, _ = spec_from_args(args)
    handle = launch_job(spec)
    try:
        while any(c is None for c in handle.exit_codes().values()):
            time.sleep(0.5)
            if any(c not in (None, 0) for c in handle.exit_codes().values()):
                break
    except KeyboardInterrupt:
        pass
    finally:
        stop_job(handle, grace_s=2.0)
        _print_tail(sys.stdout, handle)
    return 0 if all(c == 0 for c in handle.exit_codes().values()) else 1


if __name__ == "__main__":
    sys.exit(main())
