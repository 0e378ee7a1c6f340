"""The dry-run executor: records what it would do, acts on nothing.

Every call is appended as one JSON line to ``record_file`` (default
``<state dir>/dry_run.jsonl``) and the executor's view of the cluster (evicted machines, standbys
provisioned so far, code version) is rebuilt from that file on start, so a dry run survives a
service restart like a real cluster would: evicting an already evicted machine is recorded as a
no-op.  Options simulate the world for tests and rehearsals: step delays, machines failing
stop-time tests, a silently corrupting (SDC) machine for replays, transient and permanent errors,
a site without some configuration (``unconfigured``), the job's allocation; :meth:`resume`
simulates an operator repairing evicted machines (``scontrol update State=RESUME``, uncordon).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.actions.errors import PermanentError, TemporaryError
from trainguard.actions.executors.base import DiagnosticResult, ExecutorEnv, ExecutorPlugin, StepContext
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import JobSpec
from trainguard.schemas.network import MachinePosition
from trainguard.schemas.typecheck import bounds


@dataclass(frozen=True)
class DryRunConfig:
    """Settings of the dry-run executor (``actions.executor_options`` when ``executor: dry_run``)."""

    #: JSON-lines record of every call; empty: ``<state dir>/dry_run.jsonl``.
    record_file: str = ""
    #: seconds each call sleeps, by method name (``evict: 2``), e.g. to kill the service mid-step.
    delays: dict[str, float] = field(default_factory=dict)
    #: the stop-time tests this executor pretends to run (the service may pick any of them).
    tests: list[str] = field(default_factory=lambda: ["alignment", "connectivity"])
    #: test name -> machines that fail it (``alignment: [node-2]``).
    failing_tests: dict[str, list[str]] = field(default_factory=dict)
    #: machines whose replay groups fail (silent data corruption).
    sdc_machines: list[str] = field(default_factory=list)
    #: method name -> number of TemporaryErrors raised before the call succeeds.
    transient_errors: dict[str, int] = field(default_factory=dict)
    #: methods that always raise PermanentError.
    permanent_errors: list[str] = field(default_factory=list)
    #: name prefix of provisioned standbys.
    standby_prefix: str = "standby"
    #: simulated time a new standby needs for its self-check before it is ready.
    provision_s: float = field(default=0.0, metadata=bounds(0, 3600))
    #: simulated free machines new standbys start on (in this order); empty: invented names
    #: ``<standby_prefix>-<n>``.
    free_nodes: list[str] = field(default_factory=list)
    #: simulated machine positions (what ``machine_positions`` reports, as node labels would).
    positions: dict[str, MachinePosition] = field(default_factory=dict)
    #: methods to report as not configured (``unconfigured()``; calling them fails for good):
    #: rehearses a site without, say, a replay command (``[run_replay]``).
    unconfigured: list[str] = field(default_factory=list)
    #: simulated machines of the jobs' allocation (what ``usable_machines`` reports, less the
    #: evicted ones not resumed); empty: the spec's machines and standbys and the candidates.
    allocation: list[str] = field(default_factory=list)


class DryRunExecutor:
    """Records calls in a JSON-lines file; see the module docstring."""

    name = "dry_run"

    def __init__(self, cfg: DryRunConfig, env: ExecutorEnv) -> None:
        self.cfg = cfg
        self.diagnostic_tests = tuple(cfg.tests)
        self.path = Path(cfg.record_file) if cfg.record_file else env.state_dir / "dry_run.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._failures_left = dict(cfg.transient_errors)
        self.evicted: set[str] = set()
        self.provisioned = 0
        self.taken: set[str] = set()  # free_nodes already holding a standby
        for rec in self.records():
            if rec["call"] == "evict":
                self.evicted.update(rec["args"]["machines"])
            elif rec["call"] == "resume":
                self.evicted.difference_update(rec["args"]["machines"])
            elif rec["call"] == "provision_standbys":
                self.provisioned += len(rec["result"])
                self.taken.update(rec["result"])

    def records(self) -> list[dict[str, Any]]:
        """Every call recorded so far (also by earlier processes)."""
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def _call(self, call: str, job: str, ctx: StepContext, args: dict[str, Any], result: Any = None) -> None:
        if call in self.cfg.unconfigured:
            raise PermanentError(f"dry run: {call} is not configured")
        if call in self.cfg.permanent_errors:
            raise PermanentError(f"dry run: {call} configured to fail permanently")
        if self._failures_left.get(call, 0) > 0:
            self._failures_left[call] -= 1
            raise TemporaryError(f"dry run: {call} configured to fail transiently", delay=0.05)
        delay = self.cfg.delays.get(call, 0.0)
        if delay:
            time.sleep(min(delay, ctx.remaining()))
        line = {
            "ts_ms": now_ms(),
            "call": call,
            "job": job,
            "op_id": ctx.op_id,
            "decision_id": ctx.decision_id,
            "attempt": ctx.attempt,
            "args": args,
            "result": result,
        }
        with self._lock, self.path.open("a") as fh:
            fh.write(json.dumps(line) + "\n")
            fh.flush()

    def prepare(self) -> None:
        return None

    def unconfigured(self) -> dict[str, str]:
        return {m: "dry run: listed in unconfigured" for m in self.cfg.unconfigured}

    def usable_machines(self, spec: JobSpec, candidates: list[str], ctx: StepContext) -> list[str]:
        names = self.cfg.allocation or [*spec.topology.machines, *spec.standbys, *candidates]
        usable = [n for n in dict.fromkeys(names) if n not in self.evicted]
        self._call("usable_machines", spec.job, ctx, {"candidates": candidates}, usable)
        return usable

    def resume(self, machines: list[str], job: str = "") -> None:
        """An operator repaired ``machines``: no longer drained (recorded, like every call)."""
        ctx = StepContext("operator", "resume", 1, time.monotonic() + 60)
        self._call("resume", job, ctx, {"machines": machines})
        self.evicted.difference_update(machines)

    def stop(self, spec: JobSpec, ctx: StepContext) -> None:
        self._call("stop", spec.job, ctx, {"machines": spec.topology.machines})

    def evict(self, spec: JobSpec, machines: list[str], ctx: StepContext) -> None:
        fresh = [m for m in machines if m not in self.evicted]
        self._call("evict", spec.job, ctx, {"machines": fresh, "noop": not fresh, "asked": machines})
        self.evicted.update(machines)

    def provision_standbys(self, job: str, count: int, ctx: StepContext) -> list[str]:
        return self._provision(job, count, ctx, [])

    def provision_standbys_on(self, job: str, machines: list[str], ctx: StepContext) -> list[str]:
        """Standbys on the named free machines (others in ``free_nodes`` order for any taken)."""
        return self._provision(job, len(machines), ctx, machines)

    def free_machines(self, job: str) -> list[str]:
        return [n for n in self.cfg.free_nodes if n not in self.taken and n not in self.evicted]

    def machine_positions(self, names: list[str]) -> dict[str, MachinePosition]:
        return {n: self.cfg.positions[n] for n in names if n in self.cfg.positions}

    def _provision(self, job: str, count: int, ctx: StepContext, prefer: list[str]) -> list[str]:
        for rec in self.records():  # a re-run step (after a crash) gets the standbys it already made
            if rec["call"] == "provision_standbys" and rec["op_id"] == ctx.op_id:
                return list(rec["result"])
        if self.cfg.free_nodes:
            free = self.free_machines(job)
            names = ([n for n in prefer if n in free] + [n for n in free if n not in prefer])[:count]
        else:
            names = [f"{self.cfg.standby_prefix}-{self.provisioned + i}" for i in range(count)]
        if self.cfg.provision_s:
            time.sleep(min(self.cfg.provision_s, ctx.remaining()))
        self._call("provision_standbys", job, ctx, {"count": count, "prefer": prefer}, names)
        self.provisioned += len(names)
        self.taken.update(names)
        return names

    def activate_standbys(
        self, spec: JobSpec, standbys: list[str], replaces: list[str], ctx: StepContext
    ) -> None:
        self._call("activate_standbys", spec.job, ctx, {"standbys": standbys, "replaces": replaces})

    def restart(self, spec: JobSpec, ctx: StepContext) -> None:
        self._call("restart", spec.job, ctx, {"machines": spec.topology.machines})

    def hot_update(self, spec: JobSpec, version: str, ctx: StepContext) -> None:
        self._call("hot_update", spec.job, ctx, {"version": version})

    def run_diagnostics(
        self, spec: JobSpec, machines: list[str], tests: list[str], ctx: StepContext
    ) -> list[DiagnosticResult]:
        out = [
            DiagnosticResult(
                machine=m,
                test=t,
                passed=m not in self.cfg.failing_tests.get(t, []),
                detail="simulated",
            )
            for m in machines
            for t in tests
        ]
        self._call(
            "run_diagnostics",
            spec.job,
            ctx,
            {"machines": machines, "tests": tests},
            [r.machine for r in out if not r.passed],
        )
        return out

    def run_replay(self, spec: JobSpec, groups: list[list[str]], ctx: StepContext) -> list[bool]:
        ok = [not (set(g) & set(self.cfg.sdc_machines)) for g in groups]
        self._call("run_replay", spec.job, ctx, {"groups": groups}, ok)
        return ok

    def close(self) -> None:
        pass


PLUGIN = ExecutorPlugin("dry_run", DryRunConfig, DryRunExecutor)
