"""The node exporter's one config dataclass (``ExporterConfig``), one nested section per source.

Loaded like every TrainGuard component: defaults, then a YAML mapping, then environment variables
``TRAINGUARD_EXPORTER__<SECTION>__<KEY>`` (e.g. ``TRAINGUARD_EXPORTER__NIC__INTERVAL_S=15``);
unknown keys are errors.  Section names are the source names of the registry, so the config key
for a source is always ``<name>.enabled`` / ``<name>.interval_s`` (node_exporter's
``--collector.<name>``).  Default intervals are the paper's (§4.1, Table 3): GPU 10 s, NIC 30 s,
host 10 s, heartbeat 5 s.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.schemas.config import load_config
from trainguard.schemas.limits import JOB_OR_NONE, NODE_OR_NONE
from trainguard.schemas.telemetry import MAX_NICS_LISTED
from trainguard.schemas.typecheck import bounds
from trainguard.schemas.workload import MAX_FR_ENTRIES

ENV_PREFIX = "TRAINGUARD_EXPORTER"
_INTERVAL = bounds(0.01, 86_400)
#: the largest valid uid ((uid_t)-1 means "no change" to the kernel).
_MAX_UID = 2**32 - 2


@dataclass(frozen=True)
class NvmlConfig:
    enabled: bool = True
    interval_s: float = field(default=10.0, metadata=_INTERVAL)
    #: GPUs this node should have; missing ones are reported ``unavailable`` (0 = trust NVML).
    expect_gpus: int = field(default=0, metadata=bounds(0, 1024))
    #: drain NVML's Xid event queue every round (needs a driver that exposes the event API).
    xid_events: bool = True


@dataclass(frozen=True)
class KernelLogConfig:
    enabled: bool = True
    interval_s: float = field(default=1.0, metadata=_INTERVAL)
    #: ``/dev/kmsg`` or a file (dmesg/syslog style); None = ``<root>/dev/kmsg``.
    path: str | None = None
    #: publish every line, not only NVRM/Xid, OOM, I/O, filesystem and panic/BUG lines and the
    #: lines a log row of the rule table matches.
    all_lines: bool = False
    #: the rule table the workers run (a YAML file or directory; None: the built-in one): every
    #: line one of its log rows matches is published, so no rule waits for a line never shipped.
    rules: str | None = None
    #: where to start without a saved position: "beginning" (boot ring buffer included) or "end".
    start_at: str = "beginning"
    #: most lines published per round (the rest follow next round; nothing is skipped).
    max_lines_per_round: int = field(default=5000, metadata=bounds(1, 10_000_000))

    def __post_init__(self) -> None:
        if self.start_at not in ("beginning", "end"):
            raise ValueError("start_at must be 'beginning' or 'end'")


@dataclass(frozen=True)
class NicConfig:
    """Which interfaces the ``nic`` source watches (:mod:`trainguard.streams.exporter.sources.nic`).

    By default the ones that can carry training traffic: every physical interface of
    ``/sys/class/net`` (one with a ``device`` link), every InfiniBand/RoCE port of
    ``/sys/class/infiniband``, and what NCCL's variables name; never the host's virtual ones
    (loopback, bridges, veth, ifb, tun/tap, dummy, bond masters), which are often
    administratively down on healthy machines.  The heartbeat says what was watched and what was
    skipped, with why.  Regular expressions are matched at the start of the name (``re.match``);
    an InfiniBand port is named ``<hca>/<port>`` (``mlx5_0/1``).
    """

    enabled: bool = True
    interval_s: float = field(default=30.0, metadata=_INTERVAL)
    #: interfaces never watched, whatever else names them (a regular expression; "" = none).
    exclude: str = field(default="", metadata=bounds(max_len=4096))
    #: interfaces watched even though virtual or left out by NCCL's variables (e.g. ``bond0``);
    #: ``exclude`` still wins.
    include: str = field(default="", metadata=bounds(max_len=4096))
    #: NCCL_SOCKET_IFNAME syntax (``eth``, ``=eth0``, ``^docker,lo``): the interfaces it names are
    #: watched even if virtual, those a ``^`` list names are not.  None = the exporter's own
    #: NCCL_SOCKET_IFNAME variable (unset: no effect); "" = none.
    socket_ifname: str | None = field(default=None, metadata=bounds(max_len=4096))
    #: NCCL_IB_HCA syntax (``mlx5_0:1,mlx5_1``, ``=mlx5_0``, ``^mlx5_4``): when it names HCAs, only
    #: their ports are watched; a ``^`` list leaves those out.  None = the exporter's own
    #: NCCL_IB_HCA variable (unset: every port); "" = every port.
    ib_hca: str | None = field(default=None, metadata=bounds(max_len=4096))
    #: read the ports of ``/sys/class/infiniband`` at all (off: each is listed as skipped).
    infiniband: bool = True
    #: most interfaces named in each list of the heartbeat (watched, skipped); the totals count all
    #: (a Kubernetes node has a veth per pod).
    max_listed: int = field(default=64, metadata=bounds(0, MAX_NICS_LISTED))

    def __post_init__(self) -> None:
        for key in ("exclude", "include"):
            try:
                re.compile(getattr(self, key))
            except re.error as exc:
                raise ValueError(
                    f"{key}: {getattr(self, key)!r} is not a regular expression: {exc}"
                ) from None


@dataclass(frozen=True)
class HostConfig:
    enabled: bool = True
    interval_s: float = field(default=10.0, metadata=_INTERVAL)
    #: filesystem types whose mounts are not disks (pseudo and network file systems).
    skip_fs_types: list[str] = field(
        default_factory=lambda: [
            "proc",
            "sysfs",
            "devtmpfs",
            "devpts",
            "tmpfs",
            "cgroup",
            "cgroup2",
            "securityfs",
            "pstore",
            "debugfs",
            "tracefs",
            "mqueue",
            "hugetlbfs",
            "fusectl",
            "configfs",
            "bpf",
            "autofs",
            "binfmt_misc",
            "nsfs",
            "overlay",
            "squashfs",
            "rpc_pipefs",
        ]
    )


@dataclass(frozen=True)
class ProcessConfig:
    enabled: bool = True
    interval_s: float = field(default=2.0, metadata=_INTERVAL)
    #: training processes by pid ...
    pids: list[int] = field(default_factory=list)
    #: ... or by cgroup (v2 path relative to <root>/sys/fs/cgroup, e.g. "kubepods/pod1/abc") ...
    cgroup: str = ""
    #: ... or by a regular expression on the command line.
    cmd_pattern: str = ""
    #: ... and, with or without those, the ranks ``trainguard launch`` registers on the reporter
    #: socket (its children; see ``trainguard.streams.exporter.ranks``).
    registered: bool = True
    #: most launchers registered at once (a further one is refused and counted).
    max_registered: int = field(default=4096, metadata=bounds(1, 1_000_000))
    #: liveness of a job learnt from registrations goes on this long after its last rank here is
    #: gone (an empty rank list: the node is up, the job does not run here).
    registered_linger_s: float = field(default=3600.0, metadata=bounds(0, 30 * 86_400))
    #: a child whose command line or name matches is a checkpoint writer.
    checkpoint_pattern: str = r"(?i)checkpoint|ckpt"
    #: environment variable holding the rank (read from /proc/PID/environ).
    rank_env: str = "RANK"


@dataclass(frozen=True)
class HeartbeatConfig:
    enabled: bool = True
    interval_s: float = field(default=5.0, metadata=_INTERVAL)


@dataclass(frozen=True)
class ReporterConfig:
    """The Unix datagram socket training reporters send step telemetry and exits to."""

    enabled: bool = True
    interval_s: float = field(default=0.5, metadata=_INTERVAL)
    socket: str = "/run/trainguard/reporter.sock"
    #: most events held between rounds (beyond: dropped and counted).
    max_per_round: int = field(default=100_000, metadata=bounds(1, 10_000_000))
    #: file mode of the socket (YAML reads 0660 as octal): sending needs write permission, so
    #: 0660 = owner and group only.
    socket_mode: int = field(default=0o660, metadata=bounds(0, 0o777))
    #: group the socket is given (a name or a gid; "" = the exporter's own group): ranks running
    #: as another user in this group can send (their uid must still be accepted, below).
    socket_group: str = field(default="", metadata=bounds(max_len=256))
    #: sender uids accepted (kernel-verified credentials); empty = the exporter's own uid and
    #: root.  The uids of ``job_by_uid`` are accepted too.
    allowed_uids: list[int] = field(default_factory=list, metadata=bounds(0, _MAX_UID, max_items=65_536))
    #: sender uid (a decimal string: config keys are strings) -> the job its events belong to;
    #: an event claiming another job is refused.  Unmapped uids: the exporter's ``job``, if set.
    job_by_uid: dict[str, str] = field(default_factory=dict, metadata=bounds(max_len=256, max_items=65_536))

    def __post_init__(self) -> None:
        for key, job in self.job_by_uid.items():
            if not key.isdecimal() or not 0 <= int(key) <= _MAX_UID:
                raise ValueError(f"job_by_uid: key {key!r} is not a uid (0..{_MAX_UID})")
            if not job:
                raise ValueError(f"job_by_uid: uid {key} is bound to an empty job")

    @property
    def jobs_by_uid(self) -> dict[int, str]:
        """``job_by_uid`` with integer keys."""
        return {int(uid): job for uid, job in self.job_by_uid.items()}


@dataclass(frozen=True)
class StacksConfig:
    """On-demand py-spy capture (the paper's On-Demand Tracer)."""

    py_spy: str = "py-spy"
    timeout_s: float = field(default=20.0, metadata=bounds(0.5, 600))
    #: C/C++ frames too (gloo/NCCL waits); slower.
    native: bool = False
    #: py-spy processes run at once (a node has ranks x (1 + workers) processes).
    parallel: int = field(default=8, metadata=bounds(1, 256))
    max_rounds: int = field(default=100, metadata=bounds(1, 10_000))
    #: also dump the job's processes that belong to no rank (a launcher, idle warm spares).  The
    #: over-eviction verdict never reads them, and every capture waits for its slowest dump: in
    #: the demo they were a third of each machine's dumps, and a round took 1.1-2.2 s.
    unranked: bool = False


@dataclass(frozen=True)
class FlightRecorderConfig:
    """PyTorch Flight Recorder dumps of the training ranks, on a capture and on a collective
    timeout (:mod:`trainguard.streams.exporter.flight_recorder`)."""

    enabled: bool = True
    #: the directory shared with the ranks' reporters ("" = ``<dirname(reporter.socket)>/fr``,
    #: where a reporter with the same socket looks too).
    dir: str = field(default="", metadata=bounds(max_len=4096))
    #: how long a capture waits for the registered ranks' dumps (a dump takes milliseconds to a
    #: second; a rank frozen in C code without the GIL never answers).
    wait_s: float = field(default=5.0, metadata=bounds(0.1, 600))
    #: a dump file larger than this is not read (an error event instead).
    max_bytes: int = field(default=16 * 1024 * 1024, metadata=bounds(1024, 1 << 30))
    #: newest entries shipped per dump (PyTorch's ring buffer holds 2,000 by default).
    max_entries: int = field(default=2000, metadata=bounds(1, MAX_FR_ENTRIES))
    #: ... and at most this many of each process group (the newest say where it stands; a
    #: group that records hundreds of collectives a step would crowd out the quiet ones).
    max_entries_per_group: int = field(default=100, metadata=bounds(1, MAX_FR_ENTRIES))
    #: a registration whose pid is not alive here counts as a live rank while its file is this
    #: fresh (reporters refresh it every 5 s): the rank runs in another pid namespace.  0: off.
    registration_fresh_s: float = field(default=20.0, metadata=bounds(0, 3600))
    #: how often PyTorch's own timeout dumps are looked for.
    timeout_poll_s: float = field(default=2.0, metadata=bounds(0.05, 3600))
    #: a timeout dump is read once its size and mtime have not changed for this long (PyTorch
    #: may still be writing it).
    settle_s: float = field(default=1.0, metadata=bounds(0, 3600))


@dataclass(frozen=True)
class DeliveryConfig:
    spool_max_bytes: int = field(default=256 * 1024 * 1024, metadata=bounds(4096, 2**50))
    spool_segment_bytes: int = field(default=1024 * 1024, metadata=bounds(1024, 2**40))
    #: seconds between fsyncs of the open spool segment (sealed ones always are); what a node
    #: crash can lose.  0 = fsync inside every append: nothing is lost, at a disk flush per record.
    spool_fsync_interval_s: float = field(default=1.0, metadata=bounds(0, 3600))
    linger_ms: int = field(default=50, metadata=bounds(0, 60_000))
    #: a record not acknowledged within this time is re-sent from the spool.
    delivery_timeout_ms: int = field(default=30_000, metadata=bounds(1000, 3_600_000))


@dataclass(frozen=True)
class CommandsConfig:
    enabled: bool = True
    #: older commands are ignored (a restarted exporter must not replay yesterday's capture).
    max_age_s: float = field(default=300.0, metadata=bounds(1, 86_400 * 30))


@dataclass(frozen=True)
class MetricsConfig:
    """The exporter's Prometheus endpoint, ``/metrics`` (:mod:`trainguard.streams.exporter.metrics`)."""

    #: address to listen on ("" = no endpoint).  Every interface: Prometheus scrapes each node
    #: from elsewhere (node_exporter's default too); the metrics carry no secret and act on nothing.
    host: str = field(default="0.0.0.0", metadata=bounds(max_len=255))
    #: 0 = no endpoint.  9401: beside the stream workers' 9400 of the Kubernetes manifests (and
    #: not 9400, DCGM exporter's port on many GPU nodes); the action service takes 9402.
    port: int = field(default=9401, metadata=bounds(0, 65535))


@dataclass(frozen=True)
class ExporterConfig:
    """Everything one node exporter needs; see the module docstring for sources of values."""

    #: this node's name ("" = its host name); a name the codec reads (``trainguard.schemas.names``),
    #: or every record the exporter sends would be dead-lettered.
    node: str = field(default="", metadata=NODE_OR_NONE)
    job: str = field(default="", metadata=JOB_OR_NONE)
    #: prefix of every system path read (``<root>/proc``, ``<root>/sys/class/net``), like --path.procfs.
    root: str = "/"
    #: kernel-log position, spool and other state survive restarts here.
    state_dir: str = "/var/lib/trainguard/exporter"
    nvml: NvmlConfig = field(default_factory=NvmlConfig)
    kernel_log: KernelLogConfig = field(default_factory=KernelLogConfig)
    nic: NicConfig = field(default_factory=NicConfig)
    host: HostConfig = field(default_factory=HostConfig)
    process: ProcessConfig = field(default_factory=ProcessConfig)
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    reporter: ReporterConfig = field(default_factory=ReporterConfig)
    stacks: StacksConfig = field(default_factory=StacksConfig)
    flight_recorder: FlightRecorderConfig = field(default_factory=FlightRecorderConfig)
    delivery: DeliveryConfig = field(default_factory=DeliveryConfig)
    commands: CommandsConfig = field(default_factory=CommandsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @property
    def node_name(self) -> str:
        return self.node or socket.gethostname()

    @property
    def root_path(self) -> Path:
        return Path(self.root)

    @property
    def flight_recorder_dir(self) -> Path:
        """Where ranks and exporter exchange Flight Recorder dumps: ``flight_recorder.dir``, else
        ``fr`` beside the reporter socket (the reporter's default too, so one setting serves both)."""
        return Path(self.flight_recorder.dir or Path(self.reporter.socket).parent / "fr")

    def sys_path(self, absolute: str) -> Path:
        """``absolute`` (e.g. ``/proc/stat``) under the configured root."""
        return self.root_path / absolute.lstrip("/")


def load_exporter_config(
    data: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> ExporterConfig:
    """Defaults <- ``data`` <- ``TRAINGUARD_EXPORTER__*`` variables; unknown keys raise ConfigError."""
    return load_config(ExporterConfig, data, env_prefix=ENV_PREFIX, environ=environ)
