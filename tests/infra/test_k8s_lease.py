"""Leader election on a real Kubernetes Lease (the session's private API server)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from tests.net import free_port
from trainguard.infra.k8s.lease import LeaseElector
from trainguard.infra.stack.k8s import K8sCluster

pytestmark = pytest.mark.slow


class Clock:
    """A candidate's own monotonic clock, advanced by the test (the API's records are real)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def electors(cluster: K8sCluster, n: int) -> tuple[list[LeaseElector], list[Clock]]:
    from kubernetes import config

    name = f"lease-{uuid.uuid4().hex[:6]}"
    clocks = [Clock() for _ in range(n)]
    out = [
        LeaseElector(
            config.new_client_from_config(config_file=str(cluster.admin_kubeconfig)),
            "default",
            name,
            identity=f"cand-{i}",
            lease_s=15,
            renew_s=5,
            clock=clocks[i],
        )
        for i in range(n)
    ]
    return out, clocks


def test_one_leader_and_a_takeover_only_after_the_lease_runs_out(k8s_cluster: K8sCluster) -> None:
    (a, b), (_, cb) = electors(k8s_cluster, 2)
    assert a.try_acquire_or_renew() is True
    assert b.try_acquire_or_renew() is False and b.holder == "cand-0"
    assert a.try_acquire_or_renew() is True  # renewed: the record changed, b's wait restarts
    assert b.try_acquire_or_renew() is False
    cb.t += 14  # a stopped renewing, 14 s ago as b observed it: not yet
    assert b.try_acquire_or_renew() is False
    cb.t += 1
    assert b.try_acquire_or_renew() is True
    lease = a.coord.read_namespaced_lease(a.name, "default")
    assert lease.spec.holder_identity == "cand-1" and lease.spec.lease_transitions == 1
    assert a.try_acquire_or_renew() is False and a.holder == "cand-1"


def test_a_released_lease_is_taken_at_once(k8s_cluster: K8sCluster) -> None:
    (a, b), _ = electors(k8s_cluster, 2)
    assert a.try_acquire_or_renew()
    a.release()
    assert b.try_acquire_or_renew() is True


def test_racing_candidates_get_one_winner(k8s_cluster: K8sCluster) -> None:
    cands, _ = electors(k8s_cluster, 4)
    barrier = threading.Barrier(len(cands))
    won: list[str] = []

    def go(e: LeaseElector) -> None:
        barrier.wait()
        if e.try_acquire_or_renew():
            won.append(e.identity)

    threads = [threading.Thread(target=go, args=(e,)) for e in cands]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1


def test_a_leader_that_cannot_renew_stops_before_a_candidate_may_take_over(k8s_cluster: K8sCluster) -> None:
    (a,), (ca,) = electors(k8s_cluster, 1)
    assert a.try_acquire_or_renew()
    from kubernetes import client

    dead = client.Configuration()
    dead.host, dead.verify_ssl = f"https://127.0.0.1:{free_port()}", False
    dead.retries = 0
    a.api_client = client.ApiClient(dead)  # the API is gone for the leader
    stop, lost = threading.Event(), threading.Event()
    ca.t += 9  # 9 s without a renewal: inside lease_s - renew_s (10 s), still safely leading
    keeper = threading.Thread(target=a.keep, args=(stop, lost), kwargs={"interval_s": 0.02})
    keeper.start()
    time.sleep(0.5)
    assert not lost.is_set() and keeper.is_alive()
    ca.t += 1.5  # past it: the leader stops, 4.5 s before any candidate may take the Lease
    keeper.join(10)
    assert lost.is_set() and stop.is_set() and not keeper.is_alive()
