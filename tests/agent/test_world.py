""":mod:`trainguard.agent.world`: an ``agent_restart``'s arguments, read and judged (pure)."""

from __future__ import annotations

import pytest

from trainguard.agent.world import judge, world_of

ARGS = {"generation": 5, "master_addr": "n1", "master_port": 29600}


def test_a_world_of_no_machines_stops_every_agents_ranks_and_keeps_it_warm() -> None:
    """The slurm executor's warm ``stop``: every agent, active or standby, is a standby in it."""
    w = world_of({**ARGS, "nodes": []})
    assert w.nodes == ()
    assert [judge(w, 4, n) for n in ("n1", "n2")] == ["standby", "standby"]
    assert judge(w, 5, "n1") == "stale"  # and, as any world, only once


@pytest.mark.parametrize("nodes", [None, "n1,n2", ["n1", 3], ["n1", "n1"], ["../etc"]])
def test_a_malformed_node_list_is_still_refused(nodes: object) -> None:
    with pytest.raises(ValueError, match="nodes"):
        world_of({**ARGS, "nodes": nodes})
