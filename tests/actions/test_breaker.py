"""The circuit breaker (issue #36): one cause asking to evict most of a job's machines at once is
held for an operator before anything is stopped or evicted.

In a user trial (local Slurm, plain DDP, 5 nodes) a detector misreading virtual interfaces made
five NIC-down detections, five evict decisions in 0.2 s and three evict-and-restart cycles in
2 s; the blast-radius cap (8 evictions per job and hour) let them through.  The detections here
are the recorded demo run's (``tests/fixtures/incidents``), moved onto each machine of the job.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.actions.conftest import job_spec
from tests.actions.runner_harness import Harness, recorded_detections
from trainguard.actions import guard
from trainguard.actions.config import ActionsConfig, BreakerConfig
from trainguard.actions.executors.base import ExecutorEnv, StepContext
from trainguard.actions.executors.dry_run import DryRunConfig, DryRunExecutor
from trainguard.actions.state import RecoveryState
from trainguard.detectors.decide import DecisionPolicy
from trainguard.schemas.config import ConfigError, load_config
from trainguard.schemas.control import ActionPhase, Decision, JobSpec, Targets
from trainguard.schemas.enums import Action

JOB = "job-ddp"
MACHINES = [f"{JOB}-n{i}" for i in range(5)]


def _spec() -> JobSpec:
    return job_spec(JOB, n=5, standbys=5)


def _evictions(fault: str, machines: list[str], t0: int, gap_ms: int) -> list[Decision]:
    """The recorded ``fault``'s eviction reported on each of ``machines``, ``gap_ms`` apart, as the
    decide stage turns them into decisions."""
    det = next(d for d in recorded_detections(fault) if d.action is Action.EVICT and d.node)
    policy, out = DecisionPolicy(), []
    for i, m in enumerate(machines):
        t = t0 + i * gap_ms
        moved = replace(
            det, detection_id=f"{det.detection_id}-{m}", job=JOB, node=m, source_ts_ms=t, ts_ms=t + 30
        )
        dec = policy.decide(moved, now_ms=t + 40)
        assert dec is not None
        out.append(dec)
    return out


def test_five_nic_downs_on_five_of_five_machines_in_0_2_s_are_held_before_anything_is_stopped(
    tmp_path: Path,
) -> None:
    decisions = _evictions("nic-down", MACHINES, t0=1_000_000, gap_ms=50)  # 0.2 s first to last
    h = Harness(tmp_path, _spec(), now=1_000_300)
    h.accept(*decisions)
    rec = h.run(decisions[0])
    assert rec.state is RecoveryState.HELD and rec.held_step == "stop"
    assert h.calls("stop") == [] and h.calls("evict") == []  # the job keeps training
    reason = rec.held_reason
    assert reason.startswith("circuit breaker: 5 evictions of one cause (network_error, nic-state-down)")
    assert "5 of the job's 5 machines (100%)" in reason and "within 0.2 s" in reason
    assert all(m in reason for m in MACHINES) and all(d.decision_id in reason for d in decisions)
    assert all(i in reason for d in decisions for i in d.detection_ids)
    assert h.holds("breaker", "stop") == 1
    held = [e for e in h.published.actions if e.phase is ActionPhase.HELD]
    assert [(e.decision_id, e.detail) for e in held] == [(rec.decision_id, reason)]

    trip = guard.breaker_trip(h.runner.cfg, h.store, rec, ["job-ddp-n0"], 5)
    assert trip is not None and trip.machines == tuple(MACHINES) and trip.share == 1.0
    assert trip.decisions == tuple(d.decision_id for d in decisions) and trip.span_ms == 200

    # An operator's release lets this one evict; the next of the burst is held again.
    h.store.release(rec.decision_id)
    assert h.run(decisions[0]).state is RecoveryState.SUCCEEDED
    assert [c["args"]["machines"] for c in h.calls("evict")] == [[MACHINES[0]]]
    nxt = h.run(decisions[1])
    assert nxt.state is RecoveryState.HELD and nxt.held_reason.startswith("circuit breaker")
    assert len(h.calls("evict")) == 1


def test_one_release_answers_both_holds_at_the_start(tmp_path: Path) -> None:
    decisions = _evictions("nic-down", MACHINES, t0=1_000_000, gap_ms=50)
    h = Harness(tmp_path, _spec(), now=1_000_300, max_restarts=0)
    h.accept(*decisions)
    rec = h.run(decisions[0])
    assert rec.held_reason.startswith("circuit breaker") and "; restart budget: " in rec.held_reason
    assert h.holds("breaker", "stop") == 1 and h.holds("restart_budget", "stop") == 0
    h.store.release(rec.decision_id)
    assert h.run(decisions[0]).state is RecoveryState.SUCCEEDED


def test_one_eviction_never_trips_it(tmp_path: Path) -> None:
    (one,) = _evictions("nic-down", MACHINES[:1], t0=1_000_000, gap_ms=50)
    h = Harness(tmp_path, _spec(), now=1_000_300)
    h.accept(one)
    assert h.run(one).state is RecoveryState.SUCCEEDED
    assert h.calls("evict")[0]["args"]["machines"] == [MACHINES[0]]
    # Nor does one decision whose group spans most of the job (an over-eviction group).
    group = replace(one, decision_id="group", targets=Targets(machines=MACHINES[1:], group_kind="pp"))
    g = Harness(tmp_path / "group", _spec(), now=1_000_300)
    g.accept(group)
    assert g.run(group).state is RecoveryState.SUCCEEDED
    assert g.calls("evict")[0]["args"]["machines"] == MACHINES[1:]


def test_evictions_of_two_causes_do_not_trip_it(tmp_path: Path) -> None:
    nic = _evictions("nic-down", MACHINES[:2], t0=1_000_000, gap_ms=50)
    xid = _evictions("xid", MACHINES[2:4], t0=1_000_100, gap_ms=50)
    assert {d.evidence["detection"]["kind"] for d in xid} == {"xid-79"}
    h = Harness(tmp_path, _spec(), now=1_000_300)
    h.accept(*nic, *xid)  # 4 of 5 machines in 0.15 s, 2 of them per cause
    for d in (*nic, *xid):
        assert h.run(d).state is RecoveryState.SUCCEEDED, h.store.get(d.decision_id)
    assert sorted(m for c in h.calls("evict") for m in c["args"]["machines"]) == MACHINES[:4]
    assert h.holds("breaker", "stop") == 0 and h.holds("breaker", "evict") == 0


def test_only_evictions_within_one_window_count_together(tmp_path: Path) -> None:
    spread = _evictions("nic-down", MACHINES[:3], t0=1_000_000, gap_ms=70_000)  # 60 s window
    h = Harness(tmp_path, _spec(), now=1_200_000)
    h.accept(*spread)
    for d in spread:
        assert h.run(d).state is RecoveryState.SUCCEEDED
    close = _evictions("nic-down", MACHINES[2:5], t0=2_000_000, gap_ms=29_500)  # 59 s first to last
    h.accept(*close)
    assert h.run(close[0]).state is RecoveryState.HELD


class BurstDuringStop(DryRunExecutor):
    """Stopping the job takes long enough for the rest of the burst to be accepted meanwhile."""

    def __init__(self, env: ExecutorEnv) -> None:
        super().__init__(DryRunConfig(), env)
        self.arriving: list[Decision] = []
        self.harness: Harness | None = None

    def stop(self, spec: JobSpec, ctx: StepContext) -> None:
        super().stop(spec, ctx)
        assert self.harness is not None
        self.harness.accept(*self.arriving)
        self.arriving = []


def test_a_burst_that_arrives_while_the_job_stops_is_held_before_the_eviction(tmp_path: Path) -> None:
    first, *rest = _evictions("nic-down", MACHINES, t0=1_000_000, gap_ms=50)
    executor = BurstDuringStop(ExecutorEnv(state_dir=tmp_path / "executor"))
    h = Harness(tmp_path, _spec(), executor=executor, now=1_000_300)
    executor.harness, executor.arriving = h, rest
    h.accept(first)
    rec = h.run(first)
    assert rec.state is RecoveryState.HELD and rec.held_step == "evict"
    assert len(h.calls("stop")) == 1 and h.calls("evict") == []
    assert h.holds("breaker", "evict") == 1 and "5 of the job's 5 machines" in rec.held_reason


def test_without_the_jobs_size_min_machines_alone_decides(tmp_path: Path) -> None:
    decisions = _evictions("nic-down", MACHINES[:3], t0=1_000_000, gap_ms=50)
    h = Harness(tmp_path, _spec(), now=1_000_300)
    h.accept(*decisions)
    rec = h.store.get(decisions[0].decision_id)
    assert rec is not None
    trip = guard.breaker_trip(h.runner.cfg, h.store, rec, [MACHINES[0]], None)
    assert trip is not None and trip.share is None and trip.job_machines is None
    assert "3 machines of a job whose size is not known" in trip.reason(h.runner.cfg)
    # Known, 3 machines are 30% of a 10-machine job: below the 50% share.
    assert guard.breaker_trip(h.runner.cfg, h.store, rec, [MACHINES[0]], 10) is None
    off = ActionsConfig(breaker=BreakerConfig(window_s=0))
    assert guard.breaker_trip(off, h.store, rec, [MACHINES[0]], 5) is None


def test_the_breaker_is_configured_like_its_neighbours() -> None:
    cfg = load_config(ActionsConfig, {"breaker": {"window_s": 30, "machine_share": 0.8, "min_machines": 4}})
    assert cfg.breaker == BreakerConfig(window_s=30, machine_share=0.8, min_machines=4)
    assert ActionsConfig().breaker == BreakerConfig(window_s=60, machine_share=0.5, min_machines=3)
    with pytest.raises(ConfigError):
        load_config(ActionsConfig, {"breaker": {"window": 30}})
    with pytest.raises(ConfigError):
        load_config(ActionsConfig, {"breaker": {"min_machines": 1}})  # one machine is no burst
