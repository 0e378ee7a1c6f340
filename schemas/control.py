"""Control-plane events: detections, decisions, action events, node commands, dead letters.

Decisions carry a **deterministic** id (:func:`decision_id`) derived from what was decided, so a
decision re-emitted after a worker restart or a rebalance has the same id and the action service
(idempotent by id) acts on it once.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from trainguard.schemas.base import Event, register
from trainguard.schemas.enums import Action, Severity
from trainguard.schemas.limits import (
    ID,
    JOB,
    JOB_OR_NONE,
    JSON,
    NAME,
    NODE_OR_NONE,
    NODES,
    RANKS,
    TEXT,
    TS_MS,
)
from trainguard.schemas.network import MachinePosition
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.typecheck import bounds

#: most detections one decision cites.
MAX_DETECTION_IDS = 65_536


def stable_id(*parts: Any) -> str:
    """Hex id (20 bytes of SHA-1) of JSON-normalised ``parts``: same inputs, same id.

    >>> stable_id("job-1", "evict", ["node-3"]) == stable_id("job-1", "evict", ["node-3"])
    True
    >>> len(stable_id("x"))
    40
    """
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha1(blob.encode()).hexdigest()


@register
@dataclass(frozen=True)
class Detection(Event):
    """Something a rule or detector found, with the evidence that made it fire."""

    TYPE = "detection"
    detection_id: str = field(metadata=ID)
    ts_ms: int = field(metadata=TS_MS)
    job: str = field(metadata=JOB_OR_NONE)
    kind: str = field(metadata=NAME)  # rule id or detector name (xid_79, nan_loss, straggler...)
    category: str = field(metadata=NAME)  # cuda_error, nic, hang, fail_slow, user_code, ...
    severity: Severity = Severity.WARNING
    action: Action = Action.NONE  # the recommendation; the decide step makes the decision
    node: str = field(default="", metadata=NODE_OR_NONE)
    ranks: list[int] = field(default_factory=list, metadata=RANKS)
    score: float | None = field(default=None, metadata=bounds(allow_nan=False))
    message: str = field(default="", metadata=TEXT)
    evidence: dict[str, Any] = field(default_factory=dict, metadata=JSON)
    #: ts_ms of the event that triggered the detection (for detect-latency accounting).
    source_ts_ms: int = field(default=0, metadata=TS_MS)


@dataclass(frozen=True)
class Targets:
    """What a decision acts on: machines (node names), ranks, and the parallel group if any."""

    machines: list[str] = field(default_factory=list, metadata=NODES)
    ranks: list[int] = field(default_factory=list, metadata=RANKS)
    group_kind: str = field(default="", metadata=NAME)  # tp / pp / dp / machine / job


def decision_id(job: str, action: Action, targets: Targets, window_start_ms: int) -> str:
    """The deterministic id of a decision: same job, action, targets and window -> same id."""
    return stable_id(job, action.value, sorted(targets.machines), sorted(targets.ranks), window_start_ms)


@register
@dataclass(frozen=True)
class Decision(Event):
    """What to do about a job, decided from one or more detections (workers -> action service)."""

    TYPE = "decision"
    decision_id: str = field(metadata=ID)
    ts_ms: int = field(metadata=TS_MS)
    job: str = field(metadata=JOB_OR_NONE)
    action: Action
    targets: Targets = field(default_factory=Targets)
    reason: str = field(default="", metadata=TEXT)
    detection_ids: list[str] = field(
        default_factory=list, metadata=bounds(max_len=128, max_items=MAX_DETECTION_IDS)
    )
    evidence: dict[str, Any] = field(default_factory=dict, metadata=JSON)


class ActionPhase(StrEnum):
    STARTED = "started"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    HELD = "held"  # above the blast-radius cap: waits for an operator


@register
@dataclass(frozen=True)
class ActionEvent(Event):
    """One step of a recovery run by the action service (started/succeeded/failed, timed)."""

    TYPE = "action_event"
    event_id: str = field(metadata=ID)
    decision_id: str = field(metadata=ID)
    ts_ms: int = field(metadata=TS_MS)
    job: str = field(metadata=JOB_OR_NONE)
    step: str = field(metadata=NAME)  # stop / evict / swap_standby / restart / rollback / diagnose ...
    phase: ActionPhase
    action: Action = Action.NONE
    duration_ms: float = field(default=0.0, metadata=bounds(0, 1e12))
    detail: str = field(default="", metadata=TEXT)
    targets: Targets = field(default_factory=Targets)


class CommandKind(StrEnum):
    CAPTURE_STACKS = "capture_stacks"  # py-spy every training process (rounds x interval_s)
    SET_INTERVAL = "set_interval"  # change a source's sampling interval at runtime
    SET_THRESHOLD = "set_threshold"  # change a detector threshold at runtime (workers)
    #: to a job's warm node agents (``trainguard.agent``): restart the ranks in place on a new world
    #: (args: generation, nodes, master_addr, master_port, code_version = an urgent hot update).
    AGENT_RESTART = "agent_restart"
    #: to a job's node agents: a lazy hot update (args: code_version), taken at the next restart.
    AGENT_CODE = "agent_code"


#: the command kinds node agents act on (exporters skip them).
AGENT_KINDS = frozenset({CommandKind.AGENT_RESTART, CommandKind.AGENT_CODE})


@register
@dataclass(frozen=True)
class Command(Event):
    """Control plane -> node exporter (keyed by node) or -> workers (control topic)."""

    TYPE = "command"
    command_id: str = field(metadata=ID)
    ts_ms: int = field(metadata=TS_MS)
    kind: CommandKind
    node: str = field(default="", metadata=NODE_OR_NONE)  # "" = every node that reads the topic
    job: str = field(default="", metadata=JOB_OR_NONE)
    args: dict[str, Any] = field(default_factory=dict, metadata=JSON)


@register
@dataclass(frozen=True)
class DeadLetter(Event):
    """An input that could not be processed, with the precise reason; never dropped silently."""

    TYPE = "dead_letter"
    ts_ms: int = field(metadata=TS_MS)
    topic: str = field(metadata=NAME)
    reason: str = field(metadata=TEXT)
    stage: str = field(default="decode", metadata=NAME)  # decode / process / sink
    partition: int = field(default=-1, metadata=bounds(-1, 1_000_000))
    offset: int = field(default=-1, metadata=bounds(-1, 2**63 - 1))
    key: str = field(default="", metadata=bounds(max_len=4096))
    #: the offending bytes: UTF-8 text when decodable, else base64 with ``payload_b64`` set.
    payload: str = field(default="", metadata=bounds(max_len=1_048_576))
    payload_b64: bool = False


@register
@dataclass(frozen=True)
class JobSpec(Event):
    """A training job's declaration: topology, machines and standbys (launcher -> workers).

    Published when a job starts and whenever its machines change (eviction, standby swap); the
    latest spec per job is the truth (``ts_ms`` orders them).

    Version 2 added ``positions`` (each machine's pod and rack, for topology-aware swaps); a
    version 1 spec reads as one whose positions are not known.
    """

    TYPE = "job_spec"
    VERSION = 2
    UPGRADES = {1: dict}  # v1 -> v2: the fields are the same, ``positions`` takes its default
    job: str = field(metadata=JOB)
    ts_ms: int = field(metadata=TS_MS)
    topology: JobTopology
    standbys: list[str] = field(default_factory=list, metadata=NODES)
    #: stall threshold etc. overrides for this job (detector config keys -> values).
    overrides: dict[str, Any] = field(default_factory=dict, metadata=JSON)
    #: machine name -> its network position, for the job's machines and its standbys (may hold
    #: more machines, or fewer: a machine without one is placed as if alone in its pod).
    positions: dict[str, MachinePosition] = field(default_factory=dict, metadata=NODES)
