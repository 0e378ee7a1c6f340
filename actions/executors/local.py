"""The local executor: recovery steps on the demo "cluster" of real processes on this host.

A machine is a directory ``<cluster_dir>/machines/<name>/`` (its disk: checkpoints, logs, fault
hooks); its ranks are ``python -m trainguard.demo.trainer`` processes, each leading its own process
group.  The demo writes the job's launch settings to ``<cluster_dir>/jobs/<job>.json``
(:class:`trainguard.demo.config.JobSpec`); this executor applies the machine list of the JobSpec
the action service hands it and (re)starts the ranks from the latest complete checkpoint.

Processes are found again through ``/proc`` (command line ``--cluster-dir D --job J`` and
``--machine M``), not through handles, because the action service that restarts a job is not the
process that first launched it -- and must find them again after its own restart.  Every method
is idempotent: stopping stopped ranks, evicting an evicted machine or activating an active
standby does nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from actions.diagnostics import LocalFaults, run_local
from actions.errors import PermanentError, TemporaryError
from actions.executors.base import DiagnosticResult, ExecutorEnv, StepContext, register_executor
from schemas.control import JobSpec
from schemas.topology import JobTopology
from schemas.typecheck import rng
from trainguard.demo.config import JobSpec as DemoSpec


@dataclass(frozen=True)
class LocalConfig:
    """Settings of the local executor (``actions.executor_options`` with ``executor: local``)."""

    cluster_dir: str = ""
    #: gloo rendezvous ports: each (re)start takes the next one (a fresh store, no TIME_WAIT clash).
    port_base: int = field(default=29700, metadata=rng(1024, 65000))
    port_span: int = field(default=200, metadata=rng(1, 10000))
    #: grace between SIGTERM and SIGKILL when stopping ranks.
    stop_grace_s: float = field(default=3.0, metadata=rng(0, 600))
    #: standby machines are named <prefix><n>.
    standby_prefix: str = "standby-"
    diagnostics_timeout_s: float = field(default=30.0, metadata=rng(1, 3600))


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _flag(argv: list[str], name: str) -> str | None:
    with contextlib.suppress(ValueError, IndexError):
        return argv[argv.index(name) + 1]
    return None


class LocalExecutor:
    name = "local"

    def __init__(self, config: LocalConfig, env: ExecutorEnv) -> None:
        if not config.cluster_dir:
            raise PermanentError("the local executor needs executor_options.cluster_dir")
        self.cfg = config
        self.env = env
        self.cluster = Path(config.cluster_dir)
        self.state = env.state_dir / "local-executor.json"

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

    def demo_spec(self, spec: JobSpec) -> DemoSpec:
        """The demo launch settings of ``spec.job`` with the machines of ``spec``."""
        path = self.cluster / "jobs" / f"{spec.job}.json"
        try:
            demo = DemoSpec.from_json(path.read_text())
        except (OSError, ValueError) as exc:
            raise PermanentError(f"no launch settings for job {spec.job} at {path}: {exc}") from exc
        return replace(demo, machines=list(spec.topology.machines), resume=True)

    def _ranks(self, job: str, machines: set[str] | None = None) -> list[int]:
        """Pids of the job's live rank processes (optionally only on ``machines``)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            argv = _cmdline(int(entry.name))
            if _flag(argv, "--cluster-dir") != str(self.cluster):
                continue
            machine = _flag(argv, "--machine")
            if "trainguard.demo.trainer" in argv:
                mine = _flag(argv, "--job") == job
            elif "trainguard.demo.standby" in argv:  # a woken standby runs the job's ranks in place
                mine = self._activated_for(machine) == job
            else:
                continue
            if mine and (machines is None or machine in machines):
                pids.append(int(entry.name))
        return pids

    def _activated_for(self, machine: str | None) -> str | None:
        try:
            return str(
                json.loads(
                    (self.cluster / "machines" / str(machine) / "standby" / "activate.json").read_text()
                )["job"]
            )
        except (OSError, ValueError, KeyError):
            return None

    def _kill(self, pids: list[int]) -> None:
        for sig, wait in ((signal.SIGTERM, self.cfg.stop_grace_s), (signal.SIGKILL, 5.0)):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, sig)  # each rank leads its group: its DataLoader worker goes too
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(
                Path(f"/proc/{p}").exists() and _cmdline(p) for p in pids
            ):
                time.sleep(0.1)

    # -- the Executor protocol ----------------------------------------------------------------
    def stop(self, spec: JobSpec, ctx: StepContext) -> None:
        self._kill(self._ranks(spec.job))

    def evict(self, spec: JobSpec, machines: list[str], ctx: StepContext) -> None:
        self._kill(self._ranks(spec.job, set(machines)))
        for m in machines:
            d = self.cluster / "machines" / m
            d.mkdir(parents=True, exist_ok=True)
            (d / "EVICTED").write_text(f"{spec.job} {ctx.decision_id}\n")

    def provision_standbys(self, job: str, count: int, ctx: StepContext) -> list[str]:
        from trainguard.demo.launcher import launch_standby

        demo = self.demo_spec(JobSpec(job=job, ts_ms=0, topology=_topology_of(self.cluster, job)))
        state = self._load_state()
        names = []
        for _ in range(count):
            n = state.get("standby_seq", 0)
            state["standby_seq"] = n + 1
            self._save_state(state)  # a name is never reused, even if the launch below fails
            name = f"{self.cfg.standby_prefix}{n}"
            launch_standby(self.cluster, name, demo.ranks_per_machine)
            names.append(name)
        return names

    def activate_standbys(
        self, spec: JobSpec, standbys: list[str], replaces: list[str], ctx: StepContext
    ) -> None:
        # Activation happens in restart(): a standby is woken with the spec of the restarted job.
        missing = [s for s in standbys if not (self.cluster / "machines" / s / "standby").exists()]
        if missing:
            raise TemporaryError(f"standby machines {missing} have not started yet", delay=2.0)

    def restart(self, spec: JobSpec, ctx: StepContext) -> None:
        from trainguard.demo.launcher import activate_standby, launch_job, standby_ready

        if self._ranks(spec.job):
            self.stop(spec, ctx)  # a restart always starts every rank fresh from the checkpoint
        state = self._load_state()
        gen = state.get(f"gen:{spec.job}", 0) + 1
        state[f"gen:{spec.job}"] = gen
        self._save_state(state)
        demo = self.demo_spec(spec)
        demo = replace(demo, master_port=self.cfg.port_base + gen % self.cfg.port_span)
        woken, launch = [], []
        for m in demo.machine_names():
            standby_dir = self.cluster / "machines" / m / "standby"
            if (
                standby_dir.exists()
                and standby_ready(self.cluster, m, demo.ranks_per_machine)
                and not (self.cluster / "machines" / m / "standby" / "activate.json").exists()
            ):
                woken.append(m)
            else:
                launch.append(m)
        launch_job(demo, machines=launch)
        for m in woken:
            activate_standby(demo, m)
        # Persist what the job now runs on, for the demo and for the next restart.
        (self.cluster / "jobs" / f"{spec.job}.json").write_text(demo.to_json())

    def hot_update(self, spec: JobSpec, version: str, ctx: StepContext) -> None:
        from trainguard.demo import codever

        if codever.current_version(self.cluster) != version:
            codever.set_version(self.cluster, version)
        if not self._ranks(spec.job):  # the old code crashed the ranks: restart them in place
            self.restart(spec, ctx)

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
    return DemoSpec.from_json((cluster / "jobs" / f"{job}.json").read_text()).topology()


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


register_executor("local", LocalConfig, lambda cfg, env: LocalExecutor(cfg, env))
