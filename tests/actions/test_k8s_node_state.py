"""Which node states the kubernetes executor waits out and which it gives a job up for (pure:
node objects as the API client returns them, no cluster)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from trainguard.actions.executors.kubernetes import KubernetesExecutor, _transient
from trainguard.infra.k8s.bootstrap import _heartbeat_tainted


def node(ready: bool = True, cordoned: bool = False, taints: tuple[tuple[str, str], ...] = ()) -> Any:
    return SimpleNamespace(
        status=SimpleNamespace(
            conditions=[SimpleNamespace(type="Ready", status="True" if ready else "False")]
        ),
        spec=SimpleNamespace(
            unschedulable=cordoned,
            taints=[SimpleNamespace(key=k, value=None, effect=e) for k, e in taints],
        ),
    )


NEW = ("node.kubernetes.io/not-ready", "NoSchedule")
LOST = ("node.kubernetes.io/unreachable", "NoExecute")
EVICTED = ("trainguard.io/evicted", "NoExecute")


@pytest.mark.parametrize(
    ("n", "why", "transient"),
    [
        (node(), "", True),
        (node(taints=(("example.com/info", "PreferNoSchedule"),)), "", True),
        (node(taints=(NEW,)), "tainted node.kubernetes.io/not-ready", True),  # a new node
        (node(ready=False, taints=(LOST,)), "not Ready", True),  # a late heartbeat
        (node(cordoned=True), "cordoned", False),
        (node(taints=(EVICTED,)), "tainted trainguard.io/evicted", False),
        (node(taints=(NEW, EVICTED)), "tainted node.kubernetes.io/not-ready,trainguard.io/evicted", False),
    ],
)
def test_usable_and_transient(n: Any, why: str, transient: bool) -> None:
    assert KubernetesExecutor.usable(n) == why
    if why:
        assert _transient(n) is transient


def test_the_stack_waits_out_the_heartbeat_taints_only() -> None:
    assert _heartbeat_tainted(["node.kubernetes.io/not-ready=:NoSchedule"])
    assert _heartbeat_tainted(["node.kubernetes.io/unreachable=:NoExecute"])
    assert not _heartbeat_tainted(
        ["trainguard.io/evicted=dec-1:NoExecute", "node.kubernetes.io/unschedulable=:NoSchedule"]
    )
    assert not _heartbeat_tainted([])


class Nodes(KubernetesExecutor):
    """The executor over a fixed list of node objects (what ``list_node`` would return)."""

    def __init__(self, nodes: dict[str, Any]) -> None:
        self._nodes = nodes
        for name, n in nodes.items():
            n.metadata = SimpleNamespace(name=name)

    def nodes(self, ctx: Any = None) -> list[Any]:
        return list(self._nodes.values())


def test_usable_machines_are_the_jobs_nodes_and_candidates_that_take_pods_now() -> None:
    from trainguard.schemas.control import JobSpec
    from trainguard.schemas.topology import JobTopology

    ex = Nodes(
        {
            "a": node(),
            "b": node(cordoned=True, taints=(EVICTED,)),  # evicted, not repaired
            "c": node(),  # the job's standby
            "d": node(),  # an uncordoned node an operator offers
            "e": node(),  # somebody else's: not asked about
        }
    )
    topo = JobTopology(job="j", ranks_per_machine=1, dp=2, machines=["a", "b"])
    spec = JobSpec(job="j", ts_ms=1, topology=topo, standbys=["c"])
    assert ex.usable_machines(spec, ["d", "gone"], None) == ["a", "c", "d"]  # type: ignore[arg-type]
