"""Machine positions (pod, rack) from the three places a cluster states them.

* **configuration** -- a mapping ``machine -> {pod, rack}`` (:func:`positions_from_mapping`), the
  ``actions.placement.positions`` section or a file of the same shape;
* **Kubernetes node labels** -- :func:`position_from_labels` reads the first label present of a
  list of keys per level.  The defaults follow NVIDIA Topograph's labels
  (``network.topology.nvidia.com/spine`` for the spine group, ``.../leaf`` for the leaf switch),
  then the well-known ``topology.kubernetes.io/zone``, so clusters labelled either way work
  without settings;
* **Slurm's topology.conf** (``topology/tree``) -- :func:`parse_topology_conf`: a machine's rack is
  the switch listing it in ``Nodes=``, its pod that switch's ancestor ``pod_level`` levels up
  (the spine above the leaf by default); ``scontrol show topology`` prints the same lines.

All three are pure functions of plain data; the executors call them on what they read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from trainguard.actions.executors.hostlist import expand_hostlist
from trainguard.schemas.network import MachinePosition
from trainguard.schemas.typecheck import convert

#: label keys tried in order for the pod (spine group) and the rack (leaf switch).
POD_LABELS: tuple[str, ...] = ("network.topology.nvidia.com/spine", "topology.kubernetes.io/zone")
RACK_LABELS: tuple[str, ...] = ("network.topology.nvidia.com/leaf",)

_WORD = re.compile(r"(\S+?)=(\S*)")


def positions_from_mapping(data: Mapping[str, Any]) -> dict[str, MachinePosition]:
    """``{machine: {pod, rack}}`` (from a config file) as positions; unknown keys are errors.

    >>> positions_from_mapping({"n1": {"pod": "p0", "rack": "r3"}, "n2": {"pod": "p1"}})
    {'n1': MachinePosition(pod='p0', rack='r3'), 'n2': MachinePosition(pod='p1', rack='')}
    >>> positions_from_mapping({"n1": {"pod": "p0", "row": 3}})
    Traceback (most recent call last):
    ...
    trainguard.schemas.typecheck.SchemaError: positions.n1: unknown field(s) 'row'
    """
    out: dict[str, MachinePosition] = convert(dict(data), dict[str, MachinePosition], "positions")
    return out


def position_from_labels(
    labels: Mapping[str, str],
    pod_labels: Sequence[str] = POD_LABELS,
    rack_labels: Sequence[str] = RACK_LABELS,
) -> MachinePosition:
    """A node's position from its labels: the first of each list of keys that is set.

    >>> position_from_labels({"topology.kubernetes.io/zone": "z1",
    ...                       "network.topology.nvidia.com/leaf": "leaf-7"})
    MachinePosition(pod='z1', rack='leaf-7')
    >>> position_from_labels({"kubernetes.io/hostname": "n1"}).known
    False
    """

    def first(keys: Sequence[str]) -> str:
        return next((labels[k] for k in keys if labels.get(k)), "")

    return MachinePosition(pod=first(pod_labels), rack=first(rack_labels))


def positions_from_node_labels(
    nodes: Mapping[str, Mapping[str, str]],
    pod_labels: Sequence[str] = POD_LABELS,
    rack_labels: Sequence[str] = RACK_LABELS,
) -> dict[str, MachinePosition]:
    """``{node: labels}`` -> the positions of the nodes whose labels name a pod."""
    out = {}
    for name, labels in nodes.items():
        p = position_from_labels(labels, pod_labels, rack_labels)
        if p.known:
            out[name] = p
    return out


class TopologyConfError(ValueError):
    """A topology.conf line that cannot be read (no switch name, a switch listed twice)."""


def parse_topology_conf(text: str, pod_level: int = 1) -> dict[str, MachinePosition]:
    """Positions from Slurm's ``topology.conf`` (``topology/tree``) or ``scontrol show topology``.

    Each line names a switch and its children, nodes (``Nodes=``) or switches (``Switches=``),
    in Slurm's host-list syntax; keys are case-insensitive, ``#`` starts a comment, other keys
    (``LinkSpeed``, ``Level``) are ignored.  A node's rack is the switch listing it; its pod is
    that switch's ancestor ``pod_level`` levels up, or the highest one there is (a tree of
    fewer levels: the top switch is the pod).  A node listed by two switches keeps the first.

    >>> conf = "\\n".join([
    ...     "# two pods: spine1 over racks leaf1-2, spine2 over leaf3",
    ...     "SwitchName=leaf1 Nodes=n[1-2]",
    ...     "SwitchName=leaf2 Nodes=n[3-4]",
    ...     "SwitchName=leaf3 Nodes=n[5-6,9]",
    ...     "SwitchName=spine1 Switches=leaf[1-2]",
    ...     "switchname=spine2 switches=leaf3  # keys are case-insensitive",
    ...     "SwitchName=core Switches=spine[1-2] LinkSpeed=100",
    ... ])
    >>> pos = parse_topology_conf(conf)
    >>> pos["n2"], pos["n9"]
    (MachinePosition(pod='spine1', rack='leaf1'), MachinePosition(pod='spine2', rack='leaf3'))
    >>> parse_topology_conf(conf, pod_level=2)["n5"].pod
    'core'
    """
    nodes: dict[str, list[str]] = {}
    parent: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = {k.lower(): v for k, v in _WORD.findall(line)}
        if "switchname" not in fields:
            raise TopologyConfError(f"topology.conf line without SwitchName=: {line[:200]!r}")
        switch = fields["switchname"]
        if switch in nodes:
            raise TopologyConfError(f"topology.conf names switch {switch!r} twice")
        nodes[switch] = expand_hostlist(fields.get("nodes", ""))
        for child in expand_hostlist(fields.get("switches", "")):
            parent.setdefault(child, switch)
    out: dict[str, MachinePosition] = {}
    for switch, members in nodes.items():
        pod, seen = switch, {switch}
        for _ in range(pod_level):
            up = parent.get(pod)
            if up is None or up in seen:  # the top, or a loop in a broken file
                break
            pod = up
            seen.add(up)
        for node in members:
            out.setdefault(node, MachinePosition(pod=pod, rack=switch))
    return out
