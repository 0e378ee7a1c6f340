"""The topic registry: every Kafka topic's name, event type, record key and partition count.

Keys decide ordering and co-location: node telemetry is keyed by node (one node's samples stay
in order), training telemetry and decisions by job (one worker owns a job's state), commands by
node (a node's exporter reads its own commands in order).  ``trainguard stack up`` creates every
topic with these partition counts before any worker starts (Faust crashes with
``PartitionsMismatch`` on auto-created topics).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.schemas.base import Event
from trainguard.schemas.control import ActionEvent, Command, DeadLetter, Decision, Detection, JobSpec
from trainguard.schemas.telemetry import GpuSampleBatch, Heartbeat, HostSample, NicSampleBatch, NodeCheck
from trainguard.schemas.workload import (
    FlightRecorderDump,
    LogLine,
    ProcessExit,
    RankLiveness,
    StackDump,
    TrainingStep,
)

PREFIX = "trainguard."
DAY_MS = 24 * 3600 * 1000


@dataclass(frozen=True)
class Topic:
    name: str
    event: type[Event]
    #: event field whose value is the record key.
    key_field: str
    partitions: int
    retention_ms: int = 7 * DAY_MS
    #: larger than Kafka's 1 MiB default where events are big (stack dumps).
    max_message_bytes: int = 1_048_576
    doc: str = ""
    extra_configs: dict[str, str] = field(default_factory=dict)

    def key_of(self, event: Event) -> bytes:
        value = getattr(event, self.key_field)
        return str(value).encode()

    def configs(self) -> dict[str, str]:
        return {
            "retention.ms": str(self.retention_ms),
            "max.message.bytes": str(self.max_message_bytes),
            **self.extra_configs,
        }


def _t(short: str, event: type[Event], key: str, partitions: int, doc: str, **kw: object) -> Topic:
    return Topic(PREFIX + short, event, key, partitions, doc=doc, **kw)  # type: ignore[arg-type]


GPU = _t("telemetry.gpu", GpuSampleBatch, "node", 8, "NVML samples of every GPU of a node")
HOST = _t("telemetry.host", HostSample, "node", 8, "CPU/memory/disk of a node")
NIC = _t("telemetry.nic", NicSampleBatch, "node", 8, "Ethernet/InfiniBand interfaces of a node")
LOGS = _t("telemetry.logs", LogLine, "node", 8, "kernel log and training stdout/stderr lines")
HEARTBEATS = _t("telemetry.heartbeats", Heartbeat, "node", 4, "liveness of exporters/workers/services")
# Kept a month: whether a node failed its checks before is asked weeks later.
NODE_CHECKS = _t(
    "telemetry.nodechecks",
    NodeCheck,
    "node",
    4,
    "node test runs (preflight before a job) and what was done to the node",
    retention_ms=30 * DAY_MS,
)
STEPS = _t("training.steps", TrainingStep, "job", 8, "per-rank step telemetry")
# As many partitions as the steps topic: a job's exits and steps meet on the same worker.
EXITS = _t("training.exits", ProcessExit, "job", 8, "training process exits")
# As many partitions as the steps topic: a job's machines' liveness meets its steps.
LIVENESS = _t("training.liveness", RankLiveness, "job", 8, "per node: the job's ranks alive there")
STACKS = _t(
    "training.stacks", StackDump, "job", 4, "py-spy dumps per capture", max_message_bytes=8 * 1_048_576
)
# Co-partitioned with the stacks and decisions: a capture's Flight Recorder answers meet its stacks.
FLIGHT_RECORDER = _t(
    "training.flightrecorder",
    FlightRecorderDump,
    "job",
    4,
    "PyTorch Flight Recorder dumps per rank (on capture, and PyTorch's own on a collective timeout)",
    max_message_bytes=8 * 1_048_576,
)
DETECTIONS = _t("control.detections", Detection, "job", 4, "rule/detector findings with evidence")
DECISIONS = _t(
    "control.decisions",
    Decision,
    "job",
    4,
    "recovery decisions (deterministic ids)",
    retention_ms=30 * DAY_MS,
)
ACTIONS = _t("control.actions", ActionEvent, "job", 4, "action service step events", retention_ms=30 * DAY_MS)
COMMANDS = _t("control.commands", Command, "node", 4, "control plane -> node exporters")
CONTROL = _t("control.workers", Command, "job", 1, "runtime threshold changes for workers")
JOBS = _t(
    "control.jobs",
    JobSpec,
    "job",
    4,
    "job topology and machines (latest per job wins)",
    retention_ms=365 * DAY_MS,
)
DEAD_LETTERS = _t(
    "deadletter", DeadLetter, "topic", 1, "inputs that could not be processed", retention_ms=30 * DAY_MS
)

TOPICS: tuple[Topic, ...] = (
    GPU,
    HOST,
    NIC,
    LOGS,
    HEARTBEATS,
    NODE_CHECKS,
    STEPS,
    EXITS,
    LIVENESS,
    STACKS,
    FLIGHT_RECORDER,
    DETECTIONS,
    DECISIONS,
    ACTIONS,
    COMMANDS,
    CONTROL,
    JOBS,
    DEAD_LETTERS,
)
BY_NAME: dict[str, Topic] = {t.name: t for t in TOPICS}


def topic_for(event: Event) -> Topic:
    """The topic an event is published to (the first registered for its type)."""
    for t in TOPICS:
        if isinstance(event, t.event):
            return t
    raise KeyError(f"no topic carries {type(event).__name__}")


def namespaced(name: str, namespace: str) -> str:
    """The name of topic ``name`` in a topic namespace; ``""`` is the live namespace (the name itself).

    A namespace (``shadow``: what ``trainguard replay`` writes by default) is a twin of every
    topic, ``trainguard.<namespace>.<rest of the name>``, that live workers and the action service
    never read.

    >>> namespaced("trainguard.control.decisions", "shadow")
    'trainguard.shadow.control.decisions'
    >>> namespaced("trainguard.control.decisions", "")
    'trainguard.control.decisions'
    """
    if not namespace:
        return name
    if not namespace.replace("-", "").replace("_", "").isalnum() or not namespace.isascii():
        raise ValueError(f"topic namespace {namespace!r}: letters, digits, '-' and '_' only")
    return f"{PREFIX}{namespace}.{name.removeprefix(PREFIX)}"
