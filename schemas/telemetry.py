"""Machine telemetry published by the node exporter (node -> Kafka -> workers/sink).

GPU samples follow NVML's fields; a value NVML does not expose on a board is ``None`` rather
than a made-up zero, so "not supported" never looks like "healthy".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from trainguard.schemas.base import Event, register
from trainguard.schemas.limits import ID, JOB_OR_NONE, JSON, NAME, NODE, NODE_OR_NONE, TEXT, TS_MS, U64
from trainguard.schemas.typecheck import bounds


class GpuState(StrEnum):
    """What NVML could say about a GPU slot; anything but ``ok`` is itself a signal."""

    OK = "ok"
    LOST = "lost"  # NVML_ERROR_GPU_IS_LOST: fallen off the bus
    UNAVAILABLE = "unavailable"  # present in the inventory but NVML cannot query it
    NO_DRIVER = "no_driver"  # driver/library not loaded on a GPU node


#: NVML's clocks-event (throttle) reason bits (nvml.h), in bit order, and the names
#: ``GpuSample.throttle_reasons`` carries for them: part of the wire contract, so defined here,
#: where the exporter's ``nvml`` source and ``trainguard diag``'s ``gpu-health`` both read them.
THROTTLE_BITS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)


def decode_throttle(mask: int) -> list[str]:
    """Names of the set clocks-event reason bits (unknown bits as hex).

    >>> decode_throttle(0x48), decode_throttle(0x1000)
    (['hw_slowdown', 'hw_thermal_slowdown'], ['0x1000'])
    """
    names = [name for bit, name in THROTTLE_BITS if mask & bit]
    rest = mask & ~sum(bit for bit, _ in THROTTLE_BITS)
    if rest:
        names.append(hex(rest))
    return names


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one instant (NVML)."""

    index: int = field(metadata=bounds(0, 1023))
    uuid: str = field(default="", metadata=NAME)
    state: GpuState = GpuState.OK
    util_gpu_pct: float | None = field(default=None, metadata=bounds(0, 100))
    util_mem_pct: float | None = field(default=None, metadata=bounds(0, 100))
    mem_used_bytes: int | None = field(default=None, metadata=U64)
    mem_total_bytes: int | None = field(default=None, metadata=U64)
    temperature_c: float | None = field(default=None, metadata=bounds(-50, 200))
    power_w: float | None = field(default=None, metadata=bounds(0, 10_000))
    sm_clock_mhz: int | None = field(default=None, metadata=bounds(0, 100_000))
    #: NVML clocks-event (throttle) reason bitmask and its decoded names.
    throttle_mask: int | None = field(default=None, metadata=U64)
    throttle_reasons: list[str] = field(default_factory=list, metadata=bounds(max_len=256, max_items=64))
    ecc_volatile_corrected: int | None = field(default=None, metadata=U64)
    ecc_volatile_uncorrected: int | None = field(default=None, metadata=U64)
    ecc_aggregate_corrected: int | None = field(default=None, metadata=U64)
    ecc_aggregate_uncorrected: int | None = field(default=None, metadata=U64)
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = field(default=None, metadata=U64)
    remapped_rows_uncorrectable: int | None = field(default=None, metadata=U64)
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    pcie_replay_count: int | None = field(default=None, metadata=U64)
    nvlink_errors: int | None = field(default=None, metadata=U64)
    #: set when state != ok: the NVML error text.
    error: str = field(default="", metadata=bounds(max_len=4096))


@register
@dataclass(frozen=True)
class GpuSampleBatch(Event):
    """All GPUs of one node sampled together (exporter ``nvml`` source)."""

    TYPE = "gpu_batch"
    node: str = field(metadata=NODE_OR_NONE)
    ts_ms: int = field(metadata=TS_MS)
    gpus: list[GpuSample] = field(default_factory=list, metadata=bounds(max_items=1024))
    job: str = field(default="", metadata=JOB_OR_NONE)


@dataclass(frozen=True)
class DiskUsage:
    mount: str = field(metadata=bounds(max_len=1024))
    total_bytes: int = field(metadata=U64)
    used_bytes: int = field(metadata=U64)


@register
@dataclass(frozen=True)
class HostSample(Event):
    """CPU, memory, disks and processes of one node (exporter ``host`` source)."""

    TYPE = "host"
    node: str = field(metadata=NODE_OR_NONE)
    ts_ms: int = field(metadata=TS_MS)
    cpu_util_pct: float = field(metadata=bounds(0, 100))
    load1: float = field(metadata=bounds(0, 1e6))
    load5: float = field(metadata=bounds(0, 1e6))
    load15: float = field(metadata=bounds(0, 1e6))
    mem_total_bytes: int = field(metadata=U64)
    mem_available_bytes: int = field(metadata=U64)
    swap_total_bytes: int = field(default=0, metadata=U64)
    swap_used_bytes: int = field(default=0, metadata=U64)
    process_count: int = field(default=0, metadata=bounds(0, 10_000_000))
    disks: list[DiskUsage] = field(default_factory=list, metadata=bounds(max_items=10_000))
    job: str = field(default="", metadata=JOB_OR_NONE)


@dataclass(frozen=True)
class NicSample:
    """One network interface (Ethernet from /sys/class/net, or an InfiniBand port)."""

    name: str = field(metadata=NAME)
    kind: str = field(default="eth", metadata=NAME)  # "eth" or "ib"
    operstate: str = field(default="unknown", metadata=NAME)  # up/down/unknown/dormant/...
    carrier: bool | None = None
    carrier_changes: int | None = field(default=None, metadata=U64)
    rx_bytes: int | None = field(default=None, metadata=U64)
    tx_bytes: int | None = field(default=None, metadata=U64)
    rx_errors: int | None = field(default=None, metadata=U64)
    tx_errors: int | None = field(default=None, metadata=U64)
    rx_dropped: int | None = field(default=None, metadata=U64)
    tx_dropped: int | None = field(default=None, metadata=U64)
    #: InfiniBand port counters (symbol_error, link_downed, port_rcv_errors, ...) by sysfs name.
    counters: dict[str, int] = field(
        default_factory=dict, metadata=bounds(0, 2**64 - 1, max_len=256, max_items=1024)
    )
    #: the interface has not been up since the exporter started (this boot): sampled, but its
    #: being down is not a fault (an unused port, one never cabled) -- one that was up and went
    #: down is.
    never_up: bool = False


@register
@dataclass(frozen=True)
class NicSampleBatch(Event):
    """The watched interfaces of one node (exporter ``nic`` source).

    Version 2 added ``NicSample.never_up``; a version 1 batch reads as one whose interfaces have
    all been up (every down one a fault, as version 1 exporters meant it).
    """

    TYPE = "nic_batch"
    VERSION = 2
    UPGRADES = {1: dict}  # v1 -> v2: the fields are the same, ``never_up`` takes its default
    node: str = field(metadata=NODE_OR_NONE)
    ts_ms: int = field(metadata=TS_MS)
    nics: list[NicSample] = field(default_factory=list, metadata=bounds(max_items=10_000))
    job: str = field(default="", metadata=JOB_OR_NONE)


@dataclass(frozen=True)
class SourceHealth:
    """Self-report of one exporter source (node_exporter's ``*_scrape_collector_success``)."""

    name: str = field(metadata=NAME)
    ok: bool
    last_success_ms: int = field(default=0, metadata=TS_MS)
    error_count: int = field(default=0, metadata=U64)
    duration_ms: float = field(default=0.0, metadata=bounds(0, 1e9))
    last_error: str = field(default="", metadata=bounds(max_len=4096))


#: most interfaces an exporter heartbeat names in each of its lists (the totals count them all).
MAX_NICS_LISTED = 1024


@dataclass(frozen=True)
class SkippedNic:
    """An interface the exporter's ``nic`` source does not watch, and why (``virtual: bridge``,
    ``nic.exclude``, ``excluded by NCCL_SOCKET_IFNAME``, ``not in NCCL_IB_HCA``, ...)."""

    name: str = field(metadata=NAME)
    reason: str = field(metadata=NAME)


@register
@dataclass(frozen=True)
class Heartbeat(Event):
    """Periodic liveness of an exporter, worker or action service, with its sources' health.

    Version 2 added what an exporter's ``nic`` source watches (``nics_*``, empty elsewhere); a
    version 1 heartbeat reads as one that names no interface.
    """

    TYPE = "heartbeat"
    VERSION = 2
    UPGRADES = {1: dict}  # v1 -> v2: the fields are the same, the new ones take their defaults
    node: str = field(metadata=NODE_OR_NONE)
    component: str = field(metadata=NAME)  # exporter / worker / actions / reporter
    ts_ms: int = field(metadata=TS_MS)
    seq: int = field(default=0, metadata=U64)
    job: str = field(default="", metadata=JOB_OR_NONE)
    sources: list[SourceHealth] = field(default_factory=list, metadata=bounds(max_items=1024))
    #: exporters: the interfaces the ``nic`` source watches (a NIC-down fault can only come from
    #: these), sorted, at most ``nic.max_listed`` of them ...
    nics_watched: list[str] = field(
        default_factory=list, metadata=bounds(max_len=256, max_items=MAX_NICS_LISTED)
    )
    #: ... and how many it watches in all.
    nics_watched_total: int = field(default=0, metadata=U64)
    #: the interfaces it skipped, with why (sorted by name, at most ``nic.max_listed``) ...
    nics_skipped: list[SkippedNic] = field(default_factory=list, metadata=bounds(max_items=MAX_NICS_LISTED))
    #: ... and how many it skipped in all.
    nics_skipped_total: int = field(default=0, metadata=U64)


class CheckOutcome(StrEnum):
    """What a run of node tests said about the node."""

    PASSED = "passed"  # every test passed or was skipped
    FAILED = "failed"  # a test failed (or the run hung past its time limit)
    ERROR = "error"  # the tests could not judge the node (not installed, bad settings, a crash)


class CheckAction(StrEnum):
    """What was done to the node because of a check (the scheduler's word for it)."""

    NONE = "none"  # nothing to do: passed, or an error the policy lets pass
    DRAINED = "drained"  # Slurm: scontrol update State=DRAIN with TrainGuard's reason
    CORDONED = "cordoned"  # Kubernetes: spec.unschedulable and TrainGuard's annotations
    WARNED = "warned"  # policy warn: recorded only, the job starts on the node
    DRAIN_FAILED = "drain_failed"  # the drain (or cordon) was refused or timed out


@register
@dataclass(frozen=True)
class NodeCheck(Event):
    """One run of ``trainguard diag`` on a node and what came of it: a preflight before a job (a
    Slurm prolog, a Kubernetes init container) or a manual run.  Keyed by node; the history of a
    node's checks is what says whether it failed before.

    ``results`` holds each test's JSON result as ``trainguard diag --json`` prints it, by test
    name; ``reason`` is the one line the scheduler shows (``trainguard preflight: <test>:
    <finding>``), empty when the node passed.
    """

    TYPE = "node_check"
    check_id: str = field(metadata=ID)
    node: str = field(metadata=NODE)
    ts_ms: int = field(metadata=TS_MS)
    #: who ran it: ``slurm-prolog``, ``k8s-init``, ``manual``.
    origin: str = field(metadata=NAME)
    #: the scheduler's job the check ran for (a Slurm job id, a pod name); "" when none.
    job: str = field(default="", metadata=JOB_OR_NONE)
    level: str = field(default="quick", metadata=NAME)
    outcome: CheckOutcome = CheckOutcome.PASSED
    action: CheckAction = CheckAction.NONE
    #: the policy the action followed (``drain``: take the node out; ``warn``: record only).
    policy: str = field(default="drain", metadata=NAME)
    failed_tests: list[str] = field(default_factory=list, metadata=bounds(max_len=256, max_items=1024))
    reason: str = field(default="", metadata=TEXT)
    duration_s: float = field(default=0.0, metadata=bounds(0, 1e7))
    results: dict[str, Any] = field(default_factory=dict, metadata=JSON)
