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
