"""The local executor: recovery steps on the demo "cluster" of real processes on this host.

A machine is a directory ``<cluster_dir>/machines/<name>/`` (its disk: checkpoints, logs, fault
hooks); its ranks are ``python -m trainguard_demo.trainer`` processes, each leading its own process
group.  The demo writes the job's launch settings to ``<cluster_dir>/jobs/<job>.json``
(:class:`trainguard_demo.config.LaunchSpec`); this executor applies the machine list of the JobSpec
the action service hands it and (re)starts the ranks from the latest complete checkpoint.

**Warm restarts.**  A restart wakes a pool of warm processes (torch already imported, see
:mod:`trainguard_demo.standby`) on every machine that has one and cold-starts only the others;
afterwards each machine of the job gets a fresh pool in the background (``warm_pools``), started
``warm_delay_s`` late so it does not slow the ranks that are resuming.  This is the local form of
ByteRobust's in-place restart: the expensive environment set-up is paid before the failure, not
after it.

Processes are found again through ``/proc`` (command line ``--cluster-dir D --job J`` and
``--machine M``; a woken pool process takes the trainer's command line), not through handles,
because the action service that restarts a job is not the process that first launched it -- and
must find them again after its own restart.  Every method is idempotent: stopping stopped ranks,
evicting an evicted machine or activating an active standby does nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from trainguard.actions.errors import PermanentError, TemporaryError
from trainguard.actions.executors.base import DiagnosticResult, ExecutorEnv, ExecutorPlugin, StepContext
from trainguard.infra.proctable import LIVE
from trainguard.schemas.control import JobSpec
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.typecheck import bounds
from trainguard_demo import codever
from trainguard_demo.config import LaunchSpec, write_atomic
from trainguard_demo.diagnostics import LOCAL_TESTS, LocalFaults, prewarm, run_local
from trainguard_demo.launcher import (
    activate_standby,
    launch_job,
    new_pool,
    read_progress,
    ready_pools,
    standby_ready,
    start_zygote,
)
from trainguard_demo.node import start_exporter
from trainguard_demo.zygote import pending_requests, zygote_pid

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalConfig:
    """Settings of the local executor (``actions.executor_options`` with ``executor: local``)."""

    cluster_dir: str = ""
    #: gloo rendezvous ports: each (re)start takes the next one (a fresh store, no TIME_WAIT clash).
    port_base: int = field(default=29700, metadata=bounds(1024, 65000))
    port_span: int = field(default=200, metadata=bounds(1, 10000))
    #: grace between SIGTERM and SIGKILL when stopping ranks.
    stop_grace_s: float = field(default=3.0, metadata=bounds(0, 600))
    #: the ranks' SIGTERM handler only reports the exit and dies (TrainGuard's reporter, as in
    #: the demo's trainer): a stop then does not wait for their exits (see ``_kill``).  False
    #: for a trainer whose handler does real work, such as an emergency checkpoint.
    sigterm_is_final: bool = False
    #: standby machines are named <prefix><n>.
    standby_prefix: str = "standby-"
    diagnostics_timeout_s: float = field(default=30.0, metadata=bounds(1, 3600))
    #: start a node exporter on each standby machine it provisions (the demo's machines have none
    #: otherwise; a real cluster's nodes come with theirs).
    start_exporters: bool = True
    #: start a zygote on each standby machine it provisions (forks its warm pools).
    start_zygotes: bool = True
    #: start the diagnostics test server (imports torch) when the service starts.
    prewarm_diagnostics: bool = True
    #: warm pools kept per machine of the job (0: every restart cold-starts its processes).
    warm_pools: int = field(default=1, metadata=bounds(0, 4))
    #: a new pool waits this long before importing torch (the restarted ranks go first).
    warm_delay_s: float = field(default=8.0, metadata=bounds(0, 600))
    #: a replacement machine is started once the restarted job has taken its first step, or this
    #: long after the restart: on this one host its start (a zygote importing torch, an exporter)
    #: takes the CPU the restarted ranks need for that step (measured: first steps after an
    #: eviction took 0.5-2.3 s, after a plain restart 0.35-0.9 s).
    provision_wait_s: float = field(default=5.0, metadata=bounds(0, 600))


def wait_for(pred: Callable[[], object], timeout_s: float) -> bool:
    """Poll ``pred`` until it is truthy or ``timeout_s`` passes; whether it became truthy."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _cmdline(pid: int) -> list[str]:
    args = LIVE.argv(pid)
    # A renamed process (setproctitle: a woken warm process) has one space-separated title.
    return args[0].split() if len(args) == 1 else args


def _flag(argv: list[str], name: str) -> str | None:
    with contextlib.suppress(ValueError, IndexError):
        return argv[argv.index(name) + 1]
    return None


class LocalExecutor:
    name = "local"
    diagnostic_tests: tuple[str, ...] = LOCAL_TESTS

    def __init__(self, config: LocalConfig, env: ExecutorEnv) -> None:
        if not config.cluster_dir:
            raise PermanentError("the local executor needs executor_options.cluster_dir")
        self.cfg = config
        self.env = env
        self.cluster = Path(config.cluster_dir)
        self.state = env.state_dir / "local-executor.json"
        #: job -> wall time of its latest restart by this executor.
        self._restarted: dict[str, float] = {}

    # -- bookkeeping --------------------------------------------------------------------------
    def _load_state(self) -> dict[str, int]:
        try:
            data = json.loads(self.state.read_text())
            return {str(k): int(v) for k, v in data.items()}
        except (OSError, ValueError):
            return {}

    def _save_state(self, data: dict[str, int]) -> None:
        self.state.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.state)

    def launch_spec(self, spec: JobSpec) -> LaunchSpec:
        """The demo launch settings of ``spec.job`` with the machines of ``spec``."""
        path = self.cluster / "jobs" / f"{spec.job}.json"
        try:
            demo = LaunchSpec.from_json(path.read_text())
        except (OSError, ValueError) as exc:
            raise PermanentError(f"no launch settings for job {spec.job} at {path}: {exc}") from exc
        return replace(demo, machines=list(spec.topology.machines), resume=True)

    def _processes(self) -> list[tuple[int, list[str]]]:
        """(pid, argv) of every live process of this cluster: one pass over ``/proc``."""
        out = []
        for pid in LIVE.pids():
            argv = _cmdline(pid)
            if _flag(argv, "--cluster-dir") == str(self.cluster) and LIVE.alive(pid):
                out.append((pid, argv))
        return out

    def _ranks(
        self, job: str, machines: set[str] | None = None, procs: list[tuple[int, list[str]]] | None = None
    ) -> list[int]:
        """Pids of the job's live rank processes (optionally only on ``machines``)."""
        pids = []
        for pid, argv in self._processes() if procs is None else procs:
            machine = _flag(argv, "--machine")
            if "trainguard_demo.trainer" in argv:
                mine = _flag(argv, "--job") == job
            elif "trainguard_demo.standby" in argv:  # woken, before it took the trainer's title
                mine = self._activated_for(machine, _flag(argv, "--pool")) == job
            else:
                continue
            if mine and (machines is None or machine in machines):
                pids.append(pid)
        # A rank's DataLoader worker is a fork with the same command line: not a rank of its own.
        return [p for p in pids if LIVE.ppid(p) not in pids]

    def _exporters(self, machines: list[str]) -> list[int]:
        """Pids of the node exporters of ``machines`` of this cluster (by their state directory)."""
        dirs = {str(self.cluster / "machines" / m / "exporter") for m in machines}
        return [
            pid
            for pid in LIVE.pids()
            if "demo-exporter" in (argv := _cmdline(pid))
            and _flag(argv, "--state-dir") in dirs
            and LIVE.alive(pid)
        ]

    def _activated_for(self, machine: str | None, pool: str | None) -> str | None:
        try:
            path = self.cluster / "machines" / str(machine) / "standby" / str(pool) / "activate.json"
            return str(json.loads(path.read_text())["job"])
        except (OSError, ValueError, KeyError):
            return None

    def _spares(self, machine: str, procs: list[tuple[int, list[str]]] | None = None) -> dict[str, list[int]]:
        """Pool -> pids of ``machine``'s warm processes that are not activated (starting or ready)."""
        pools: dict[str, list[int]] = {}
        for pid, argv in self._processes() if procs is None else procs:
            if "trainguard_demo.standby" in argv and _flag(argv, "--machine") == machine:
                pool = str(_flag(argv, "--pool"))
                if self._activated_for(machine, pool) is None:
                    pools.setdefault(pool, []).append(pid)
        return pools

    def _kill(self, pids: list[int], grace_s: float | None = None, wait: bool = True) -> None:
        """Stop ``pids`` (and their process groups): SIGTERM, then SIGKILL after ``grace_s``
        (default ``stop_grace_s``; 0 for idle processes that hold nothing worth a clean exit).
        ``wait=False`` (with ``grace_s=0`` only): send SIGKILL and return.

        A *doomed* process is not waited for once SIGTERM is sent: one that takes SIGTERM by its
        default action, or any rank when ``sigterm_is_final`` says its handler only reports the
        exit and dies.  It runs no more of its training code (the handler runs before the next
        Python statement: no further step, no checkpoint rename), and only its exit is left,
        which the kernel schedules when a core is free -- 0.4-1.4 s for eight ranks on the demo's
        two busy cores, every second of it with the job stopped.  A background timer still
        SIGKILLs a doomed process that outlives the grace (a handler stuck behind a C call).  A
        process with a handler that may do real work (a graceful shutdown) gets its grace."""
        t0 = time.monotonic()
        grace = self.cfg.stop_grace_s if grace_s is None else grace_s
        if grace > 0:
            doomed = self._signal(pids, signal.SIGTERM)
            self._escalate_later(doomed, grace)
            waited = [p for p in pids if p not in doomed]
            if not wait_for(lambda: not any(LIVE.alive(p) for p in waited), grace):
                self._signal([p for p in waited if LIVE.alive(p)], signal.SIGKILL)
                wait_for(lambda: not any(LIVE.alive(p) for p in waited), 5.0)
        else:
            self._signal(pids, signal.SIGKILL)
            if wait:
                wait_for(lambda: not any(LIVE.alive(p) for p in pids), 5.0)
        took = time.monotonic() - t0
        if took > 1.0:  # every second here is a second of the job stopped
            log.warning("stopping %d processes took %.2f s (grace %.1f s)", len(pids), took, grace)

    def _signal(self, pids: list[int], sig: signal.Signals) -> set[int]:
        """Send ``sig`` to each pid's process group (each rank leads its group: its DataLoader
        worker goes too); the pids it reached that it dooms (see :meth:`_kill`)."""
        doomed = set()
        for pid in pids:
            # Read before sending: once delivered, the answer is gone with the process.
            fatal = sig is signal.SIGKILL or self.cfg.sigterm_is_final or LIVE.takes_default(pid, sig)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)
                if fatal:
                    doomed.add(pid)
        return doomed

    def _escalate_later(self, pids: set[int], grace_s: float) -> None:
        """SIGKILL, after ``grace_s``, whichever of ``pids`` still runs -- the same process (its
        start time unchanged), never a new one that got its pid."""
        started = {p: st.starttime for p in pids if (st := LIVE.stat(p)) is not None and st.alive}
        if not started:
            return

        def escalate() -> None:
            late = [p for p, t in started.items() if (st := LIVE.stat(p)) and st.alive and st.starttime == t]
            if late:
                log.warning("%d stopped processes outlived their %.1f s grace: SIGKILL", len(late), grace_s)
                self._signal(late, signal.SIGKILL)

        timer = threading.Timer(grace_s, escalate)
        timer.daemon = True
        timer.start()

    # -- the Executor protocol ----------------------------------------------------------------
    def prepare(self) -> None:
        # Start the stop-time tests' torch server now, not in the first recovery (seconds).
        if self.cfg.prewarm_diagnostics:
            prewarm()
            # And one throwaway round of the tests: the first diagnosis after the server starts
            # pays for its children's first use of torch's libraries (a demo run: 2.9 s for the
            # first diagnosis, 0.45 s for the next, on the same four machines; here 1.4 s, then
            # 0.3-0.8 s) -- with the job stopped.  Pass or fail, the answers are not used.
            run_local(["prewarm-0", "prewarm-1"], self.diagnostic_tests, timeout_s=30.0)

    def stop(self, spec: JobSpec, ctx: StepContext) -> None:
        self._kill(self._ranks(spec.job))

    def evict(self, spec: JobSpec, machines: list[str], ctx: StepContext) -> None:
        procs = self._processes()
        spares = [pid for m in machines for pids in self._spares(m, procs).values() for pid in pids]
        zygotes = [p for m in machines if (p := zygote_pid(self.cluster, m)) is not None]
        # The machine leaves with its pools and its zygote: idle processes, killed outright and
        # not waited for -- nothing of the job runs on them any more (its ranks were stopped
        # before, with their grace), and the restart need not wait for their exit.
        self._kill(self._ranks(spec.job, set(machines), procs) + spares + zygotes, grace_s=0, wait=False)
        # ... and with its node agent: a machine handed to repair publishes nothing more.  On this
        # one host the agents of evicted machines kept running and piled up (12 exporters at the
        # start of a demo run, 18 at its end, each 4-8% of a core, with the stream worker's
        # detection latency growing from 0.4 s to 6-21 s over the run).
        for pid in self._exporters(machines):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)  # it flushes its spool and leaves; not waited for
        for m in machines:
            d = self.cluster / "machines" / m
            d.mkdir(parents=True, exist_ok=True)
            (d / "EVICTED").write_text(f"{spec.job} {ctx.decision_id}\n")

    def provision_standbys(self, job: str, count: int, ctx: StepContext) -> list[str]:
        demo = self.launch_spec(JobSpec(job=job, ts_ms=0, topology=_topology_of(self.cluster, job)))
        state = self._load_state()
        self._after_first_step(demo, ctx)
        names = []
        for _ in range(count):
            n = state.get("standby_seq", 0)
            state["standby_seq"] = n + 1
            self._save_state(state)  # a name is never reused, even if the launch below fails
            name = f"{self.cfg.standby_prefix}{n}"
            home = self.cluster / "machines" / name
            home.mkdir(parents=True, exist_ok=True)
            (home / "provisioned").write_text(f"{time.time()}\n")  # its time to ready is measured
            if self.cfg.start_zygotes:  # the pool waits in the queue until the zygote is ready
                start_zygote(self.cluster, name)
                wait_for(partial(zygote_pid, self.cluster, name), 5.0)
            new_pool(self.cluster, name, demo.ranks_per_machine, warm_delay_s=self.cfg.warm_delay_s)
            if self.cfg.start_exporters:
                start_exporter(self.cluster, name, job)  # a machine comes with its node agent
            names.append(name)
        return names

    def activate_standbys(
        self, spec: JobSpec, standbys: list[str], replaces: list[str], ctx: StepContext
    ) -> None:
        # Activation happens in restart(): a standby is woken with the spec of the restarted job.
        missing = [s for s in standbys if not (self.cluster / "machines" / s / "standby").exists()]
        if missing:
            raise TemporaryError(f"standby machines {missing} have not started yet", delay=2.0)

    def ready_standbys(self, spec: JobSpec, standbys: list[str]) -> list[str]:
        """The standbys with a whole warm pool waiting: activating one wakes processes at once."""
        return [s for s in standbys if standby_ready(self.cluster, s, spec.topology.ranks_per_machine)]

    def restart(self, spec: JobSpec, ctx: StepContext) -> None:
        self._kill(self._ranks(spec.job))  # a restart always starts every rank fresh from the checkpoint
        state = self._load_state()
        gen = state.get(f"gen:{spec.job}", 0) + 1
        state[f"gen:{spec.job}"] = gen
        self._save_state(state)
        demo = self.launch_spec(spec)
        demo = replace(demo, master_port=self.cfg.port_base + gen % self.cfg.port_span)
        # Persist what the job runs on before waking anyone: the demo and the next restart read it.
        # Atomically: the demo's live view and the next step read it while it changes (a plain
        # write let the demo read it empty and crash, run 2 of a three-run measurement).
        write_atomic(self.cluster / "jobs" / f"{spec.job}.json", demo.to_json())
        cold = []
        for m in demo.machine_names():
            ready = ready_pools(self.cluster, m, demo.ranks_per_machine)
            if ready:
                activate_standby(demo, m, ready[0])
            else:
                cold.append(m)
        launch_job(demo, machines=cold)
        self._restarted[spec.job] = time.time()
        self._replenish(demo.machine_names(), demo.ranks_per_machine)

    def _after_first_step(self, demo: LaunchSpec, ctx: StepContext) -> None:
        """Wait (``provision_wait_s`` at most) until every rank of the job's latest restart has
        finished a step; at once when this executor did not restart it."""
        job = demo.job
        since = self._restarted.get(job)
        if since is None or self.cfg.provision_wait_s <= 0:
            return

        def stepped() -> bool:
            progress = read_progress(demo)
            return len(progress) == demo.world_size and all(
                p.get("status") == "running" and float(p.get("ts", 0)) > since for p in progress.values()
            )

        if not wait_for(stepped, min(self.cfg.provision_wait_s, max(0.0, ctx.remaining()))):
            log.info("job %s took no step within %.1f s of its restart: provisioning anyway", job,
                     self.cfg.provision_wait_s)  # fmt: skip

    def _replenish(self, machines: list[str], slots: int) -> None:
        """Start a warm pool on each machine that has fewer than ``warm_pools`` spare ones (forked
        by the machine's zygote when it has one: ready in milliseconds, not tens of seconds)."""
        procs = self._processes()
        for m in machines:
            for _ in range(
                self.cfg.warm_pools - len(self._spares(m, procs)) - pending_requests(self.cluster, m)
            ):
                new_pool(self.cluster, m, slots, warm_delay_s=self.cfg.warm_delay_s)

    def hot_update(self, spec: JobSpec, version: str, ctx: StepContext) -> None:
        # Only the version switch: every plan restarts the job in its next step (a restart here
        # too would kill the ranks just woken and cold-start the next generation).  Running ranks
        # pick the version up in place at their next step (trainguard_demo.codever).
        if codever.current_version(self.cluster) != version:
            codever.set_version(self.cluster, version)

    def run_diagnostics(
        self, spec: JobSpec, machines: list[str], tests: list[str], ctx: StepContext
    ) -> list[DiagnosticResult]:
        faults = _diag_faults(self.cluster, machines)
        return run_local(
            machines, tests, faults, timeout_s=min(self.cfg.diagnostics_timeout_s, ctx.remaining())
        )

    def run_replay(self, spec: JobSpec, groups: list[list[str]], ctx: StepContext) -> list[bool]:
        raise PermanentError("dual-phase replay is not available on the local executor: an operator decides")

    def close(self) -> None:
        return None


def _topology_of(cluster: Path, job: str) -> JobTopology:
    return LaunchSpec.from_json((cluster / "jobs" / f"{job}.json").read_text()).topology()


def _diag_faults(cluster: Path, machines: list[str]) -> LocalFaults:
    """Machines whose ``diagnostics.json`` says they fail a stop-time test (set by fault injection)."""
    perturb, corrupt, absent = set(), set(), set()
    for m in machines:
        with contextlib.suppress(OSError, ValueError):
            d = json.loads((cluster / "machines" / m / "diagnostics.json").read_text())
            if d.get("perturb"):
                perturb.add(m)
            if d.get("corrupt"):
                corrupt.add(m)
            if d.get("absent"):
                absent.add(m)
    return LocalFaults(frozenset(perturb), frozenset(corrupt), frozenset(absent))


PLUGIN = ExecutorPlugin("local", LocalConfig, LocalExecutor)
