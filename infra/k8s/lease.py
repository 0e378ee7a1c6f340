"""Leader election on a Kubernetes Lease: at most one action service acts at a time.

The action service drives recoveries with side effects (evictions, restarts): two active
replicas would double them.  With ``actions.leader_lease: <namespace>/<name>`` the service runs
only while it holds that ``coordination.k8s.io/v1`` Lease, as client-go's leader election does:

* a candidate takes the Lease when nobody holds it, or when its record has not changed for
  ``lease_s`` as *this candidate observed it* (the holder's clock is never compared with ours:
  skew-safe), and renews it every ``renew_s``; every write is a compare-and-swap on the
  Lease's resourceVersion, so of two candidates racing one wins and the other sees a conflict;
* a leader that cannot renew for ``lease_s`` (API unreachable, or another holder now) has lost:
  the service stops and exits non-zero -- in a Deployment its pod restarts as a candidate.
  The leader stops acting *before* the others may take over: it gives up after ``lease_s`` -
  ``renew_s`` without a successful renewal, while a candidate waits the full ``lease_s``;
* a leader that stops cleanly releases the Lease (holder cleared), so a successor starts at once.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

log = logging.getLogger(__name__)


def default_identity() -> str:
    """The pod's name in a Deployment (its hostname), plus the pid."""
    return f"{socket.gethostname()}-{os.getpid()}"


class LeaseElector:
    """Take, renew and release one Lease; see the module docstring."""

    def __init__(
        self,
        api_client: Any,
        namespace: str,
        name: str,
        identity: str = "",
        lease_s: float = 15.0,
        renew_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if renew_s >= lease_s:
            raise ValueError("renew_s must be shorter than lease_s")
        self.api_client = api_client
        self.namespace, self.name = namespace, name
        self.identity = identity or default_identity()
        self.lease_s, self.renew_s = lease_s, renew_s
        self.clock = clock
        #: (resourceVersion, when we first saw it): how long the record has stood still.
        self._observed: tuple[str, float] = ("", 0.0)
        self.last_renewed = 0.0
        self.holder = ""

    @property
    def coord(self) -> Any:
        from kubernetes import client

        return client.CoordinationV1Api(self.api_client)

    def _now(self) -> datetime:
        return datetime.now(UTC)

    def try_acquire_or_renew(self) -> bool:
        """One attempt: True when this candidate holds the Lease afterwards."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        now = self._now()
        try:
            lease = self.coord.read_namespaced_lease(self.name, self.namespace, _request_timeout=5)
        except ApiException as exc:
            if exc.status != 404:
                raise
            body = client.V1Lease(
                metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=client.V1LeaseSpec(
                    holder_identity=self.identity,
                    lease_duration_seconds=int(self.lease_s),
                    acquire_time=now,
                    renew_time=now,
                    lease_transitions=0,
                ),
            )
            try:
                self.coord.create_namespaced_lease(self.namespace, body, _request_timeout=5)
            except ApiException as exc2:
                if exc2.status == 409:  # another candidate created it first
                    return False
                raise
            return self._won()
        spec = lease.spec
        version = lease.metadata.resource_version
        if version != self._observed[0]:
            self._observed = (version, self.clock())
        self.holder = spec.holder_identity or ""
        stale = self.clock() - self._observed[1] >= self.lease_s
        if self.holder and self.holder != self.identity and not stale:
            return False
        if self.holder != self.identity:
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
            spec.holder_identity = self.identity
        spec.renew_time = now
        spec.lease_duration_seconds = int(self.lease_s)
        try:  # resourceVersion in the body: the API refuses a write over a newer record (409)
            self.coord.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=5)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return self._won()

    def _won(self) -> bool:
        self.holder = self.identity
        self.last_renewed = self.clock()
        return True

    def acquire(self, stop: threading.Event, on_wait: Callable[[str], None] = lambda holder: None) -> bool:
        """Block until this candidate leads (True) or ``stop`` is set (False)."""
        told = ""
        while not stop.is_set():
            try:
                if self.try_acquire_or_renew():
                    return True
            except Exception as exc:
                log.warning("leader lease %s/%s: %s", self.namespace, self.name, exc)
            if self.holder != told:
                told = self.holder
                on_wait(self.holder)
            stop.wait(self.renew_s)
        return False

    def keep(self, stop: threading.Event, lost: threading.Event, interval_s: float | None = None) -> None:
        """Renew every ``renew_s`` (or ``interval_s``) until ``stop``; set ``lost`` and ``stop``
        once leadership is gone."""
        while not stop.wait(self.renew_s if interval_s is None else interval_s):
            try:
                ok = self.try_acquire_or_renew()
            except Exception as exc:
                log.warning("leader lease %s/%s: renewal failed: %s", self.namespace, self.name, exc)
                ok = False
            if ok:
                continue
            if self.holder and self.holder != self.identity:
                log.error("leader lease %s/%s taken by %s", self.namespace, self.name, self.holder)
            elif self.clock() - self.last_renewed < self.lease_s - self.renew_s:
                continue  # not renewed this time; still safely ours
            lost.set()
            stop.set()
            return

    def release(self) -> None:
        """Give the Lease up now (holder cleared), if this candidate still holds it."""
        try:
            lease = self.coord.read_namespaced_lease(self.name, self.namespace, _request_timeout=5)
            if lease.spec.holder_identity != self.identity:
                return
            lease.spec.holder_identity = None
            lease.spec.acquire_time = None
            lease.spec.renew_time = None
            self.coord.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=5)
        except Exception as exc:
            log.warning("leader lease %s/%s: release failed: %s", self.namespace, self.name, exc)
