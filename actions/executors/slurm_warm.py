"""The Slurm executor's warm path (issue #37 item 2): ``stop``, ``restart`` and ``hot_update``
through the job's node agents, in the same allocation and the same ``srun`` step, when every
agent of the new node list is warm (for ``stop`` and a code switch: of the running step's
nodes; :mod:`trainguard.actions.executors.agents`).

Each method answers whether the warm path did the step; False means the executor goes on with
its cold path (``scancel``, a new ``srun`` step), and the reason is logged and recorded as a
command of the step (so the action event says which path was taken and why).  An agent that
refuses or times out mid-restart also ends in the cold path: it cancels the training step, agents
and all, and starts a new one -- a failed warm restart costs a cold one, never a dead job.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from trainguard.actions.executors import agents
from trainguard.actions.executors.base import StepContext
from trainguard.schemas.control import JobSpec

if TYPE_CHECKING:
    from trainguard.actions.executors.slurm import SlurmExecutor

log = logging.getLogger(__name__)


class Probed(NamedTuple):
    """What :meth:`SlurmWarmPath._probe` found: the agents' answers, the nodes' addresses, the
    running step's nodes, and why the warm path is not there ("" when it is)."""

    probes: list[agents.AgentProbe]
    addrs: dict[str, str]
    old: list[str]
    why: str


class SlurmWarmPath:
    """The agents of one Slurm executor's jobs; see the module docstring."""

    def __init__(self, ex: SlurmExecutor) -> None:
        self.ex = ex
        #: the last restart's path, for tests and operators: {"job", "op_id", "path", "why", ...}.
        self.last: dict[str, Any] = {}

    def _note(self, ctx: StepContext, what: str, rc: int, text: str, t0: float) -> None:
        from trainguard.actions.executors.slurm import CommandRecord

        took = time.monotonic() - t0
        self.ex._record(CommandRecord(["trainguard-agents", what], rc, took, text, "", ctx.op_id))

    def _ports(self) -> tuple[int, int]:
        lo, hi = self.ex.cfg.agent_master_ports  # two, checked by the config
        return lo, hi

    def _probe(
        self, spec: JobSpec, job_id: str, new: list[str], ctx: StepContext, must: list[str] | None = None
    ) -> Probed:
        """The agents of the running step's nodes (old) and ``new``, and whether those of ``must``
        (default: all of them) are warm."""
        old = sorted({n for s in self.ex.training_steps(job_id, ctx) for n in s.nodes})
        if not old:
            return Probed([], {}, old, "no training step runs (no agents to restart in place)")
        if self.ex.signer is None:
            return Probed([], {}, old, "signing is off (an agent takes no unsigned command)")
        union = old + [n for n in new if n not in old]
        addrs = {n: r.get("NodeAddr", "") for n, r in self.ex.nodes(union, ctx).items()}
        cfg = self.ex.cfg
        per_node = (cfg.tasks_per_node or spec.topology.ranks_per_machine) if cfg.agent_per_rank else 1
        urls = agents.agent_urls(union, addrs, cfg.agent_ports, cfg.agent_port, per_node)
        probes = agents.probe(urls, min(cfg.agent_timeout_s, 5.0))
        needed = union if must is None else must
        verdict = agents.warm_verdict([p for p in probes if p.node in needed], needed)
        return Probed(probes, addrs, old, verdict)

    def restart(self, spec: JobSpec, job_id: str, nodes: list[str], ctx: StepContext) -> bool:
        """Restart the ranks in place on ``nodes`` (spec order) when every agent is warm."""
        t0 = time.monotonic()
        # Only the new world's agents must be warm: an evicted machine's agent is often gone with
        # its machine, and its ranks (if any still run) are told to stop when it answers; a stale
        # rank cannot rejoin, the new world has a fresh MASTER_PORT and generation.
        probes, addrs, old, why = self._probe(spec, job_id, nodes, ctx, must=nodes)
        # A hot update since the agents started: this restart carries its version (urgent); a
        # cold restart loads the switched code anyway, so either path consumes it.
        version = self.ex._take_agent_code(spec.job)
        if not why:
            world = agents.next_world(probes, nodes, addrs, self._ports())
            assert self.ex.signer is not None  # _probe said warm
            needed = [p for p in probes if p.node in nodes]
            leaving = [p for p in probes if p.node not in nodes and p.doc]
            failed = agents.send_restarts(
                spec.job, world, needed, self.ex.signer, self.ex.cfg.agent_timeout_s, version
            )
            if leaving:  # best effort: a machine leaving the job keeps no ranks of it
                gone = agents.send_restarts(
                    spec.job, world, leaving, self.ex.signer, self.ex.cfg.agent_timeout_s
                )
                if gone:
                    log.warning("slurm: agents leaving %s did not stop their ranks: %s", spec.job, gone)
            if not failed:
                self.ex._bump_generation(spec.job, world.generation)
                detail = (
                    f"generation {world.generation} on {list(world.nodes)} "
                    f"(was {old}), MASTER={world.master_addr}:{world.master_port}, {len(probes)} agents"
                )
                self._done(spec, ctx, "warm", detail, t0, world.generation)
                return True
            why = f"agents failed mid-restart ({'; '.join(failed)}): the training step is restarted cold"
        # Newer than anything sent, the failed restart's world included.
        self._quiet(spec, probes, addrs, max((p.generation for p in probes), default=0) + 2)
        self._done(spec, ctx, "cold", why, t0)
        return False

    def _quiet(self, spec: JobSpec, probes: list[agents.AgentProbe], addrs: dict[str, str], gen: int) -> None:
        """Before the cold path: every agent that answers stops its ranks (a world of no machines,
        newer than any it was sent).  The step's own agents die with ``scancel`` anyway; this is
        for agents outside it (a standby's ``trainguard agent`` step in ``keep_steps``) that
        joined the failed world and would otherwise keep its ranks running beside the new step."""
        answering = [p for p in probes if p.doc]
        if not answering or self.ex.signer is None:
            return
        world = agents.next_world(answering, [], addrs, self._ports())._replace(generation=gen)
        failed = agents.send_restarts(spec.job, world, answering, self.ex.signer, self.ex.cfg.agent_timeout_s)
        if failed:
            log.warning("slurm: agents of %s not stopped before the cold restart: %s", spec.job, failed)

    def stop(self, spec: JobSpec, job_id: str, ctx: StepContext) -> bool:
        """Stop the ranks and keep the agents warm (a world of no machines) when all are warm."""
        t0 = time.monotonic()
        probes, addrs, old, why = self._probe(spec, job_id, [], ctx)
        if not why:
            world = agents.next_world(probes, [], addrs, self._ports())
            assert self.ex.signer is not None
            limit = self.ex.cfg.agent_timeout_s
            failed = agents.send_restarts(spec.job, world, probes, self.ex.signer, limit)
            if not failed:
                self._note(ctx, "stop", 0, f"warm path: ranks of {old} stopped, agents warm", t0)
                log.info("slurm: stop of %s: warm path, the agents on %s stopped their ranks", spec.job, old)
                return True
            why = f"agents failed to stop their ranks ({'; '.join(failed)})"
        self._quiet(spec, probes, addrs, max((p.generation for p in probes), default=0) + 2)
        self._note(ctx, "stop", 1, f"cold path: {why}", t0)
        log.info("slurm: stop of %s: cold path (scancel): %s", spec.job, why)
        return False

    def code(self, spec: JobSpec, job_id: str, version: str, ctx: StepContext) -> None:
        """A hot update's switch: every warm agent pre-warms a zygote on ``version`` (lazy), so
        the restart that follows (carrying the version) forks from it at once."""
        t0 = time.monotonic()
        self.ex._set_agent_code(spec.job, version)
        probes, _, _, why = self._probe(spec, job_id, [], ctx)
        if why or self.ex.signer is None:
            self._note(ctx, "code", 1, f"no warm agents to pre-warm {version}: {why}", t0)
            return
        failed = agents.send_code(spec.job, version, probes, self.ex.signer, self.ex.cfg.agent_timeout_s)
        self._note(ctx, "code", 1 if failed else 0, "; ".join(failed) or f"{version} pre-warming", t0)

    def _done(
        self, spec: JobSpec, ctx: StepContext, path: str, why: str, t0: float, generation: int = 0
    ) -> None:
        self.last = {"job": spec.job, "op_id": ctx.op_id, "path": path, "why": why, "generation": generation}
        self._note(ctx, "restart", 0 if path == "warm" else 1, f"{path} path: {why}", t0)
        log.info("slurm: restart of %s: %s path: %s", spec.job, path, why)
