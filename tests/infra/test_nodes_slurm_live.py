"""A node's way back on a real Slurm (issue #39, item 4): a drained node marked repaired is
validated by a job step on it and resumed only when it passes; a second eviction within the
window quarantines it.

A private cluster of two nodes in a temporary stack home on free ports (as
``tests/infra/test_preflight_slurm_live.py`` builds it) and a chDB store.  The evictions are what
the action service leaves behind: the node drained with the decision's reason, and a succeeded
``evict`` action event in ClickHouse.  The validation is the real ``trainguard diag --level
standard`` limited to ``gemm-digest`` (the other standard tests want GPUs or minutes on two
shared cores), run by ``srun`` inside the node's reservation; a wrong ``--expected-digest`` makes
it fail.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.actions.slurm_fixture import private_stack_env
from trainguard.actions.node_config import NodeReturnConfig
from trainguard.actions.node_return import NodeReturn, TransitionStore
from trainguard.actions.node_slurm import SlurmNodes
from trainguard.actions.node_states import TransitionRefused
from trainguard.commands.nodes import nodes
from trainguard.infra.clickhouse import named
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.config import load_settings
from trainguard.infra.stack.slurm import Slurm
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import ActionEvent, ActionPhase, Targets
from trainguard.schemas.enums import Action

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
DIAG = [sys.executable, "-m", "trainguard", "diag", "--level", "{level}", "--test", "gemm-digest", "--json"]
WRONG_DIGEST = "0" * 64


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Slurm]:
    slurm = Slurm(load_settings(environ=private_stack_env(tmp_path / "home", 2)).stack, nodes=2)
    try:
        slurm.start()
        slurm.wait_idle(60)
        yield slurm
    finally:
        slurm.stop()


@pytest.fixture
def chdb(chdb_dir: Path) -> Iterator[ClickHouseStore]:
    db = f"tgnodes_{uuid.uuid4().hex[:10]}"
    st = ClickHouseStore(replace(load_settings(environ={}).clickhouse, dsn=f"chdb://{chdb_dir}", database=db))
    st.migrate()
    yield st
    st.command(f"DROP DATABASE IF EXISTS {db}")
    st.close()


def service(cluster: Slurm, store: ClickHouseStore, *extra: str) -> NodeReturn:
    cfg = NodeReturnConfig(
        slurm_conf=str(cluster.conf_file), validate_command=[*DIAG, *extra], validate_timeout_s=240
    )
    # the step runs this checkout's trainguard (srun passes the environment on)
    environ = {**os.environ, **cluster.env(), "PYTHONPATH": str(ROOT)}
    return NodeReturn(cfg, TransitionStore(store), SlurmNodes(cfg, environ))


def evict(cluster: Slurm, store: ClickHouseStore, node: str, decision: str) -> None:
    """What the action service's evict step leaves: the node drained, the event in ClickHouse."""
    res = cluster.run(
        "scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason=trainguard {decision}: xid in llm"
    )
    assert res.returncode == 0, res.stderr
    store.insert_events(
        [
            ActionEvent(
                event_id=f"{decision}-evict", decision_id=decision, ts_ms=now_ms(), job="llm", step="evict",
                phase=ActionPhase.SUCCEEDED, action=Action.EVICT, targets=Targets(machines=[node], ranks=[]),
            )
        ]
    )  # fmt: skip


def node(cluster: Slurm, name: str) -> dict[str, str]:
    return next(n for n in cluster.nodes() if n["name"] == name)


def test_repaired_node_is_validated_and_resumed_and_a_second_eviction_quarantines(
    cluster: Slurm, chdb: ClickHouseStore
) -> None:
    evict(cluster, chdb, "n1", "dec-1")
    nr = service(cluster, chdb)
    assert [t.to_state.value for t in nr.sync()] == ["evicted"]

    # A validation that fails leaves the node drained with the finding, waiting for repair.
    failing = service(cluster, chdb, "--expected-digest", WRONG_DIGEST)
    new = failing.repaired("n1", "alice", "req-1")
    assert [(t.to_state.value, t.cause.value) for t in new] == [
        ("validating", "repaired"),
        ("awaiting_repair", "validation_failed"),
    ], new
    held = node(cluster, "n1")
    assert held["state"].startswith("drain"), held
    assert held["reason"].startswith("trainguard validation: trainguard preflight: gemm-digest"), held
    assert "trainguard-validate-n1" not in cluster.run("scontrol", "show", "reservation").stdout

    # Repaired again; this time it passes: resumed, the reservation gone, returned.
    new = nr.repaired("n1", "bob", "req-2")
    assert [t.to_state.value for t in new] == ["validating", "returned"], new
    assert new[-1].detail.startswith("diag standard passed; resumed by slurm")
    assert node(cluster, "n1")["state"] == "idle", cluster.nodes()
    assert "trainguard-validate-n1" not in cluster.run("scontrol", "show", "reservation").stdout

    # A second eviction within 14 days: quarantined, drained with the quarantine as its reason.
    evict(cluster, chdb, "n1", "dec-2")
    assert [t.to_state.value for t in nr.sync()] == ["evicted", "quarantined"]
    out = node(cluster, "n1")
    assert out["state"].startswith("drain") and out["reason"].startswith(
        "trainguard quarantine: evicted 2 times"
    ), out
    with pytest.raises(TransitionRefused, match="quarantined"):
        nr.repaired("n1", "alice", "req-3")
    assert node(cluster, "n1")["state"].startswith("drain")

    # The same through the command line: refused with what to do, and listed as quarantined.
    settings = replace(
        load_settings(environ={}),
        clickhouse=chdb.cfg,
        components={"nodes": {"slurm_conf": str(cluster.conf_file)}},
    )
    res = CliRunner().invoke(nodes, ["repaired", "n1", "--by", "alice"], obj={"settings": settings})
    assert res.exit_code == 1 and "a person releases it with `trainguard nodes release`" in res.output, (
        res.output
    )
    res = CliRunner().invoke(nodes, ["list", "--json"], obj={"settings": settings})
    assert res.exit_code == 0, res.output
    (listed,) = map(json.loads, res.output.splitlines())
    assert (listed["node"], listed["state"], listed["evictions_in_window"]) == ("n1", "quarantined", 2)

    rows = named.get("node_transitions").run(chdb, node="n1")
    assert [(r["from_state"], r["to_state"], r["cause"]) for r in rows] == [
        ("", "evicted", "eviction"),
        ("evicted", "validating", "repaired"),
        ("validating", "awaiting_repair", "validation_failed"),
        ("awaiting_repair", "validating", "repaired"),
        ("validating", "returned", "validation_passed"),
        ("returned", "evicted", "eviction"),
        ("evicted", "quarantined", "quarantine"),
    ]
    assert [r["by"] for r in rows][:2] == ["dec-1", "alice"] and rows[3]["by"] == "bob"
    assert rows[5]["by"] == rows[6]["by"] == "dec-2"
