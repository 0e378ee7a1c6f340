"""The way back against a real store (ClickHouse 18.16 and chDB): evictions read from the action
events and preflights, transitions recorded once, the validation's verdict acted on in the right
order, the named query and ``trainguard nodes`` reading it back.

The scheduler here is a recorder of calls with a verdict set by the test (the real Slurm one is
``tests/infra/test_nodes_slurm_live.py``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from trainguard.actions.errors import SchedulerError, UnknownNode
from trainguard.actions.node_config import NodeReturnConfig
from trainguard.actions.node_return import NodeReturn, TransitionStore
from trainguard.actions.node_slurm import SlurmNodes
from trainguard.actions.node_states import DAY_MS, TransitionRefused
from trainguard.commands.nodes import nodes
from trainguard.diag.preflight import Verdict
from trainguard.infra.clickhouse import named
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.config import load_settings
from trainguard.schemas.control import ActionEvent, ActionPhase, Targets
from trainguard.schemas.enums import Action
from trainguard.schemas.nodes import NodeState
from trainguard.schemas.telemetry import CheckAction, CheckOutcome, NodeCheck

T0 = 1_795_000_000_000


class RecordingScheduler:
    """Knows nodes n1..n3; validate returns ``self.verdict``; every call is kept in ``calls``."""

    name = "slurm"

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.verdict = Verdict(CheckOutcome.PASSED, duration_s=1.5)
        self.fail_hold = False

    def node(self, node: str) -> None:
        if node not in ("n1", "n2", "n3"):
            raise UnknownNode(f"Slurm has no node {node!r}")

    def validate(self, node: str) -> Verdict:
        self.calls.append(("validate", node))
        return self.verdict

    def resume(self, node: str) -> None:
        self.calls.append(("resume", node))

    def hold(self, node: str, reason: str) -> None:
        if self.fail_hold:
            raise RuntimeError("scontrol: connection refused")
        self.calls.append(("hold", node, reason))


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def evict_event(decision: str, machine: str, ts_ms: int) -> ActionEvent:
    return ActionEvent(
        event_id=f"{decision}-evict",
        decision_id=decision,
        ts_ms=ts_ms,
        job="llm",
        step="evict",
        phase=ActionPhase.SUCCEEDED,
        action=Action.EVICT,
        targets=Targets(machines=[machine], ranks=[]),
    )


@pytest.fixture
def svc(store: ClickHouseStore) -> tuple[NodeReturn, RecordingScheduler, Clock]:
    sched, clock = RecordingScheduler(), Clock()
    return NodeReturn(NodeReturnConfig(), TransitionStore(store), sched, clock), sched, clock


def states(svc: NodeReturn, node: str) -> list[str]:
    return [t.to_state.value for t in svc.transitions.history(node)]


def test_evicted_repaired_validated_returned(svc: tuple[NodeReturn, RecordingScheduler, Clock]) -> None:
    nr, sched, clock = svc
    nr.transitions.store.insert_events([evict_event("dec-1", "n1", T0 - 60_000)])
    assert [t.to_state for t in nr.sync()] == [NodeState.EVICTED]
    assert nr.sync() == []  # read again: nothing new
    clock.now = T0 + 1000
    new = nr.repaired("n1", "alice", "req-1")
    assert (new[0].to_state.value, new[0].by) == ("validating", "alice")
    assert sched.calls == [("validate", "n1"), ("resume", "n1")]
    assert states(nr, "n1") == ["evicted", "validating", "returned"]
    last = nr.transitions.history("n1")[-1]
    check_id = last.by
    assert last.detail == "diag standard passed; resumed by slurm"
    # the validation is a node_checks row too (origin validation), found by the transition's id
    (row,) = nr.transitions.store.query(
        "SELECT origin, level, outcome FROM node_checks FINAL WHERE check_id = %(c)s", {"c": check_id}
    )
    assert row == ("validation", "standard", "passed")
    # the named query shows each transition with its cause and who
    rows = named.get("node_transitions").run(nr.transitions.store, node="n1")
    assert [(r["to_state"], r["cause"], r["by"]) for r in rows] == [
        ("evicted", "eviction", "dec-1"),
        ("validating", "repaired", "alice"),
        ("returned", "validation_passed", check_id),
    ]


def test_a_failed_validation_holds_before_recording(
    svc: tuple[NodeReturn, RecordingScheduler, Clock],
) -> None:
    nr, sched, clock = svc
    nr.transitions.store.insert_events([evict_event("dec-1", "n2", T0)])
    nr.sync()
    clock.now = T0 + 1000
    sched.verdict = Verdict(
        CheckOutcome.FAILED, "trainguard preflight: memory: cpu: 3 bad words", ("memory",)
    )
    sched.fail_hold = True
    with pytest.raises(RuntimeError, match="connection refused"):
        nr.repaired("n2", "bob", "req-1")
    assert states(nr, "n2") == ["evicted", "validating"]  # not recorded as held: it was not
    sched.fail_hold = False
    nr.repaired("n2", "bob", "req-2")  # repeated: validates again
    assert states(nr, "n2") == ["evicted", "validating", "awaiting_repair"]
    assert sched.calls[-1] == (
        "hold",
        "n2",
        "trainguard validation: trainguard preflight: memory: cpu: 3 bad words",
    )
    assert "failed: trainguard preflight: memory" in nr.transitions.history("n2")[-1].detail


def test_a_second_eviction_quarantines_and_holds(svc: tuple[NodeReturn, RecordingScheduler, Clock]) -> None:
    nr, sched, clock = svc
    store = nr.transitions.store
    store.insert_events([evict_event("dec-1", "n3", T0)])
    nr.sync()
    clock.now = T0 + 1000
    nr.repaired("n3", "alice", "req-1")
    # a preflight drained it 3 days later: the second eviction in 14 days
    check = NodeCheck(
        check_id="chk-pre", node="n3", ts_ms=T0 + 3 * DAY_MS, origin="slurm-prolog", job="77",
        outcome=CheckOutcome.FAILED, action=CheckAction.DRAINED, reason="trainguard preflight: gemm-digest: differs",
    )  # fmt: skip
    store.insert_events([check])
    clock.now = T0 + 3 * DAY_MS + 1000
    assert [t.to_state.value for t in nr.sync()] == ["evicted", "quarantined"]
    assert sched.calls[-1] == (
        "hold", "n3", "trainguard quarantine: evicted 2 times in 14 days (limit 2): a person decides"
    )  # fmt: skip
    with pytest.raises(TransitionRefused, match="quarantined"):
        nr.repaired("n3", "alice", "req-2")
    nr.release("n3", "carol", "rel-1", "PSU replaced")
    nr.repaired("n3", "alice", "req-3")
    assert states(nr, "n3")[-3:] == ["awaiting_repair", "validating", "returned"]


def test_unknown_nodes_are_refused_before_anything_is_recorded(
    svc: tuple[NodeReturn, RecordingScheduler, Clock],
) -> None:
    nr, _, _ = svc
    with pytest.raises(UnknownNode, match="no node 'n9'"):
        nr.repaired("n9", "alice", "req-1")
    assert nr.transitions.history("n9") == []


def test_the_cli_lists_and_shows_history(
    store: ClickHouseStore, svc: tuple[NodeReturn, RecordingScheduler, Clock]
) -> None:
    nr, _, clock = svc
    store.insert_events([evict_event("dec-1", "n1", T0), evict_event("dec-2", "n2", T0)])
    nr.sync()
    clock.now = T0 + 1000
    nr.repaired("n1", "alice", "req-1")
    settings = replace(load_settings(environ={}), clickhouse=store.cfg)
    run = CliRunner().invoke
    res = run(nodes, ["list", "--no-sync", "--all", "--json"], obj={"settings": settings})
    assert res.exit_code == 0, res.output
    got = {
        r["node"]: (r["state"], r["evictions_in_window"]) for r in map(json.loads, res.output.splitlines())
    }
    assert got == {"n1": ("returned", 1), "n2": ("evicted", 1)}
    res = run(nodes, ["list", "--no-sync"], obj={"settings": settings})
    assert res.exit_code == 0 and "n2" in res.output and "n1" not in res.output, res.output
    res = run(nodes, ["history", "n1"], obj={"settings": settings})
    assert res.exit_code == 0, res.output
    assert [line.split("  ")[2] for line in res.output.splitlines()] == [
        "- -> evicted",
        "evicted -> validating",
        "validating -> returned",
    ]
    res = run(nodes, ["history", "n7"], obj={"settings": settings})
    assert res.exit_code == 1 and "node n7 has no recorded eviction" in res.output


@pytest.mark.parametrize("bad", ["../n1", "-x", "n1;reboot"])
def test_the_cli_refuses_hostile_node_names(bad: str) -> None:
    for cmd in (["repaired", bad], ["release", bad], ["history", bad]):
        res = CliRunner().invoke(nodes, [*cmd[:1], "--", cmd[1]], obj={"settings": load_settings(environ={})})
        assert res.exit_code == 2 and "Invalid value for 'NODE'" in res.output, res.output


def test_the_cli_says_when_slurm_cannot_be_asked(tmp_path: Path) -> None:
    # a slurm.conf that names no controller: the error is Slurm's, not "no such node"
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=none\n")
    settings = replace(load_settings(environ={}), components={"nodes": {"slurm_conf": str(conf)}})
    with pytest.raises(SchedulerError, match="cannot ask Slurm about node n1"):
        SlurmNodes(NodeReturnConfig(slurm_conf=str(conf))).node("n1")
    res = CliRunner().invoke(nodes, ["release", "n1"], obj={"settings": settings})
    assert res.exit_code == 1 and "Error: cannot ask Slurm about node n1" in res.output, res.output
