"""The action service's swaps and refills follow the placement planner (no broker: the runner
alone, on the dry-run executor)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tests.actions.conftest import make_decision
from trainguard.actions.config import ActionsConfig
from trainguard.actions.executors.base import ExecutorEnv
from trainguard.actions.executors.dry_run import DryRunConfig, DryRunExecutor
from trainguard.actions.progress import ProgressStore
from trainguard.actions.recovery import RecoveryRunner
from trainguard.actions.state import RecoveryState
from trainguard.detectors.placement import PlacementConfig
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import ActionEvent, JobSpec
from trainguard.schemas.enums import Action
from trainguard.schemas.network import MachinePosition as P
from trainguard.schemas.topology import JobTopology


class Events:
    def __init__(self) -> None:
        self.actions: list[ActionEvent] = []
        self.specs: list[JobSpec] = []

    def action(self, event: ActionEvent) -> None:
        self.actions.append(event)

    def job_spec(self, spec: JobSpec) -> None:
        self.specs.append(spec)


#: machine i runs (dp = i % 2, pp = i // 2): DP groups {n0, n1} and {n2, n3}, pipelines {n0, n2}
#: and {n1, n3}.  n0, n1 sit in pod a, n2, n3 in pod b; the pool lists a's standby first.
POSITIONS = {
    "n0": P("a", "r1"),
    "n1": P("a", "r2"),
    "n2": P("b", "r1"),
    "n3": P("b", "r2"),
    "warm-a": P("a", "r3"),
    "warm-b": P("b", "r3"),
}


def _spec(job: str, positions: dict[str, P] | None = None) -> JobSpec:
    topo = JobTopology(job=job, tp=1, pp=2, dp=2, ranks_per_machine=1, machines=["n0", "n1", "n2", "n3"])
    return JobSpec(
        job=job, ts_ms=now_ms(), topology=topo, standbys=["warm-a", "warm-b"], positions=positions or {}
    )


def _evict(
    tmp_path: Path, spec: JobSpec, cfg: ActionsConfig, executor: DryRunExecutor | None = None
) -> tuple[Events, DryRunExecutor, dict[str, Any]]:
    executor = executor or DryRunExecutor(DryRunConfig(), ExecutorEnv(state_dir=tmp_path / "executor"))
    store, events = ProgressStore(tmp_path / "progress.sqlite"), Events()
    runner = RecoveryRunner(cfg, store, executor, events, lambda _job: spec)
    decision = make_decision(spec.job, Action.EVICT, ["n2"])
    assert store.accept(decision, decision.ts_ms)
    assert runner.run(decision.decision_id).state is RecoveryState.SUCCEEDED
    return events, executor, store.step_results(decision.decision_id)


def _activated(executor: DryRunExecutor) -> list[str]:
    (call,) = [r for r in executor.records() if r["call"] == "activate_standbys"]
    return list(call["args"]["standbys"])


def _swap_detail(events: Events) -> str:
    (ev,) = [e for e in events.actions if e.step == "swap_standbys" and e.phase.value == "succeeded"]
    return ev.detail


def test_the_swap_takes_the_standby_in_the_evicted_machines_pod(tmp_path: Path) -> None:
    events, executor, results = _evict(tmp_path, _spec("job-near", POSITIONS), ActionsConfig(spec_wait_s=0))
    assert _activated(executor) == ["warm-b"]  # not warm-a, first in the pool
    assert "['n2'] -> ['warm-b']; dp_spread 1->1 pp_spread 2->2 (exact)" in _swap_detail(events)
    placement = results["swap_standbys"]["placement"]
    assert placement["dp_spread"] == [1, 1] and placement["method"] == "exact"
    assert events.specs[0].topology.machines == ["n0", "n1", "warm-b", "n3"]
    assert events.specs[0].positions == POSITIONS  # carried on


def test_without_the_planner_the_swap_takes_the_first_standby(tmp_path: Path) -> None:
    cfg = ActionsConfig(spec_wait_s=0, placement=PlacementConfig(enabled=False))
    events, executor, _ = _evict(tmp_path, _spec("job-first", POSITIONS), cfg)
    assert _activated(executor) == ["warm-a"]
    assert "dp_spread 1->2 pp_spread 2->2 (first_free)" in _swap_detail(events)


def test_positions_come_from_configuration_and_from_the_executor(tmp_path: Path) -> None:
    configured = {k: v for k, v in POSITIONS.items() if k.startswith("n")}
    cfg = ActionsConfig(spec_wait_s=0, placement=PlacementConfig(positions=configured))
    standbys = {"warm-a": POSITIONS["warm-a"], "warm-b": POSITIONS["warm-b"]}
    executor = DryRunExecutor(DryRunConfig(positions=standbys), ExecutorEnv(state_dir=tmp_path / "executor"))
    events, _, _ = _evict(tmp_path, _spec("job-learnt"), cfg, executor)
    assert _activated(executor) == ["warm-b"]
    assert events.specs[0].positions == POSITIONS  # the new spec carries what was learnt


def test_the_pool_is_refilled_in_the_pod_left_without_a_standby(tmp_path: Path) -> None:
    free = {"f-a1": P("a", "r9"), "f-a2": P("a", "r9"), "f-b1": P("b", "r9")}
    executor = DryRunExecutor(
        DryRunConfig(free_nodes=["f-a1", "f-a2", "f-b1"], positions=free),
        ExecutorEnv(state_dir=tmp_path / "executor"),
    )
    cfg = ActionsConfig(spec_wait_s=0, min_standbys=2)
    _, _, results = _evict(tmp_path, _spec("job-refill", POSITIONS), cfg, executor)
    # warm-b went into pod b: b has no standby left, a still has warm-a.
    assert results["replenish"]["provisioned"] == ["f-b1"]


def test_a_short_pool_provisions_where_the_planner_says(tmp_path: Path) -> None:
    free = {"f-a1": P("a", "r9"), "f-b1": P("b", "r9")}
    executor = DryRunExecutor(
        DryRunConfig(free_nodes=["f-a1", "f-b1"], positions=free),
        ExecutorEnv(state_dir=tmp_path / "executor"),
    )
    spec = replace(_spec("job-short", POSITIONS), standbys=[])
    _, _, results = _evict(tmp_path, spec, ActionsConfig(spec_wait_s=0), executor)
    assert results["swap_standbys"]["provisioned"] == ["f-b1"]
    assert results["swap_standbys"]["activated"] == ["f-b1"]


class BlindExecutor(DryRunExecutor):
    """An executor whose topology probe fails (an API server down, an unreadable file)."""

    def machine_positions(self, names: list[str]) -> dict[str, P]:
        raise OSError("topology unreadable")


def test_a_failing_topology_probe_costs_the_placement_not_the_swap(tmp_path: Path) -> None:
    executor = BlindExecutor(DryRunConfig(free_nodes=["f1"]), ExecutorEnv(state_dir=tmp_path / "executor"))
    cfg = ActionsConfig(spec_wait_s=0, min_standbys=2)
    events, _, results = _evict(tmp_path, _spec("job-blind"), cfg, executor)
    assert _activated(executor) == ["warm-a"]  # pool order, as before the planner
    assert "(first_free)" in _swap_detail(events)
    assert results["replenish"]["provisioned"] == ["f1"]  # the executor's own choice
