"""Where a machine sits in the cluster network: its pod (spine group) and rack (leaf switch).

A large training cluster is a tree of switches: machines hang off a rack's leaf switch, racks off
a pod's spine switches, pods off the core.  Traffic inside a pod stays below the spines; traffic
between pods crosses the core, where bandwidth is oversubscribed.  Arnold (ByteDance's scheduler)
therefore places a job so each of its communication groups spans as few pods as possible, and
TrainGuard's placement planner (:mod:`trainguard.detectors.placement`) keeps it so through recoveries.

:class:`MachinePosition` is that position as data, carried per machine in the job's
:class:`~trainguard.schemas.control.JobSpec` (``positions``).  Rack names are only unique within their pod
(``rack_key`` qualifies them); an empty pod or rack means "not known".

>>> p = MachinePosition(pod="pod-2", rack="r07")
>>> p.rack_key, MachinePosition(pod="pod-2").known, MachinePosition().known
('pod-2/r07', True, False)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.schemas.limits import NAME


@dataclass(frozen=True)
class MachinePosition:
    """One machine's pod (spine group) and rack (leaf switch); "" where not known."""

    pod: str = field(default="", metadata=NAME)
    rack: str = field(default="", metadata=NAME)

    @property
    def known(self) -> bool:
        """Whether the pod is known (a rack without its pod says nothing about core traffic)."""
        return bool(self.pod)

    @property
    def rack_key(self) -> str:
        """The rack qualified by its pod (two pods may both have a rack "r1")."""
        return f"{self.pod}/{self.rack}" if self.rack else ""
