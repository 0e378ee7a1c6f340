"""Events about the training workload: step telemetry, log lines, process exits, stack dumps.

Producers: the training reporter (inside rank processes), the launcher (``trainguard launch``: a
rank's registration and its exit status) and the node exporter (kernel log, process tracking,
on-demand py-spy tracer).  ``loss`` and ``grad_norm`` may be NaN/Inf on the
wire on purpose: a non-finite loss is the very signal the NaN detector looks for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.schemas.base import Event, register, register_local
from trainguard.schemas.enums import ProcessRole
from trainguard.schemas.limits import (
    I64,
    JOB_OR_NONE,
    MAX_RANKS_LISTED,
    NAME,
    NODE_OR_NONE,
    PID,
    RANK,
    RANK_OR_NONE,
    RANKS,
    TS_MS,
    U64,
)
from trainguard.schemas.typecheck import bounds

#: most threads, frames per thread and processes in one dump; py-spy prints one frame per Python
#: (and with ``--native`` native) call, so even a deep recursion fits, and the record size limit
#: of the stacks topic (8 MiB) is reached long before these are.
MAX_THREADS = 65_536
MAX_FRAMES = 65_536
MAX_PROCESSES = 65_536


@register
@dataclass(frozen=True)
class TrainingStep(Event):
    """One optimizer step of one rank (training reporter)."""

    TYPE = "training_step"
    job: str = field(metadata=JOB_OR_NONE)
    rank: int = field(metadata=RANK)
    step: int = field(metadata=bounds(0, 2**62))
    ts_ms: int = field(metadata=TS_MS)
    node: str = field(default="", metadata=NODE_OR_NONE)
    loss: float | None = field(default=None, metadata=bounds(allow_nan=True))
    grad_norm: float | None = field(default=None, metadata=bounds(0, None, allow_nan=True))
    step_time_s: float | None = field(default=None, metadata=bounds(0, 1e7))
    tokens: int | None = field(default=None, metadata=bounds(0, 2**62))
    tokens_per_s: float | None = field(default=None, metadata=bounds(0, 1e15))
    mfu: float | None = field(default=None, metadata=bounds(0, 1))
    #: reporter queue drops since the last delivered step (never silently lost).
    dropped: int = field(default=0, metadata=bounds(0, 2**62))
    #: time the step waited for its batch (the training loop's ``next(batches)``); with
    #: ``step_time_s``, how much of the step the data loader starved compute (slow-data detector).
    data_wait_s: float | None = field(default=None, metadata=bounds(0, 1e7))


#: The ``source`` of the lines the node exporter's own sources read from the machine: the kernel
#: log (``kernel``) and NVML's Xid events (``nvml``).  A training process may not claim them (the
#: exporter's reporter socket refuses it), so only these lines may match the rule table's
#: ``origin: node`` rows (kernel, driver and firmware faults that evict a machine).
NODE_LOG_SOURCES = frozenset({"kernel", "nvml"})


@register
@dataclass(frozen=True)
class LogLine(Event):
    """One line of a kernel log or of a training process's stdout/stderr."""

    TYPE = "log_line"
    node: str = field(metadata=NODE_OR_NONE)
    ts_ms: int = field(metadata=TS_MS)
    source: str = field(metadata=NAME)  # kernel / stdout / stderr / file path
    line: str = field(metadata=bounds(max_len=65_536))
    #: position in the source (byte offset or line number) -- with node+source, the dedup key.
    seq: int = field(default=0, metadata=I64)
    job: str = field(default="", metadata=JOB_OR_NONE)
    rank: int = field(default=-1, metadata=RANK_OR_NONE)


@register
@dataclass(frozen=True)
class ProcessExit(Event):
    """A training process (or one of its children) ended."""

    TYPE = "process_exit"
    node: str = field(metadata=NODE_OR_NONE)
    ts_ms: int = field(metadata=TS_MS)
    pid: int = field(metadata=PID)
    job: str = field(default="", metadata=JOB_OR_NONE)
    rank: int = field(default=-1, metadata=RANK_OR_NONE)
    role: ProcessRole = ProcessRole.MAIN
    exit_code: int | None = field(default=None, metadata=bounds(-255, 255))
    signal: int | None = field(default=None, metadata=bounds(0, 128))
    reason: str = field(default="", metadata=bounds(max_len=4096))
    traceback: str = field(default="", metadata=bounds(max_len=262_144))

    def __post_init__(self) -> None:
        if self.exit_code is None and self.signal is None and not self.reason:
            raise ValueError("a process exit needs an exit_code, a signal or a reason")


@register_local
@dataclass(frozen=True)
class RankRegistration(Event):
    """A rank's main process, named by the launcher that started it (launcher -> its node's exporter,
    over the reporter socket; node-local: never published).

    The exporter follows the process and its children as the rank's (liveness, exits, stacks)
    with no process selection configured, and only while ``pid`` is a child of the kernel-verified
    sender: a sender can name its own children, nothing else.  Pids are as the launcher sees
    them.  Sent again every few seconds, so an exporter started (or restarted) after the launcher
    learns the rank too; the same registration again changes nothing."""

    TYPE = "rank_registration"
    job: str = field(metadata=JOB_OR_NONE)
    node: str = field(metadata=NODE_OR_NONE)
    rank: int = field(metadata=RANK)
    local_rank: int = field(metadata=RANK)
    #: the rank's main process (the launcher's child) and the launcher itself.
    pid: int = field(metadata=PID)
    launcher_pid: int = field(metadata=PID)
    ts_ms: int = field(metadata=TS_MS)


@register
@dataclass(frozen=True)
class RankLiveness(Event):
    """A node's exporter's view of a job's ranks on it, every round of its process source: which
    ranks' main processes exist and their states.  Keyed by job (co-partitioned with the steps),
    so the worker that judges the job's progress also sees whether each of its machines still
    speaks: a machine that froze or died sends neither steps nor these."""

    TYPE = "rank_liveness"
    job: str = field(metadata=JOB_OR_NONE)
    node: str = field(metadata=NODE_OR_NONE)
    ts_ms: int = field(metadata=TS_MS)
    #: the ranks with a live main process on the node, and each one's process state letter
    #: (``R`` running, ``S`` sleeping, ``D`` uninterruptible -- a driver or file system wait).
    ranks: list[int] = field(default_factory=list, metadata=RANKS)
    states: list[str] = field(default_factory=list, metadata=bounds(max_len=4, max_items=MAX_RANKS_LISTED))
    #: how often the node sends these (the worker's silence bound is a multiple of it).
    interval_s: float = field(default=2.0, metadata=bounds(0.05, 3600))
    seq: int = field(default=0, metadata=U64)

    def __post_init__(self) -> None:
        if len(self.states) != len(self.ranks):
            raise ValueError(f"{len(self.ranks)} ranks but {len(self.states)} states")


@dataclass(frozen=True)
class Frame:
    function: str = field(metadata=bounds(max_len=1024))
    filename: str = field(default="", metadata=bounds(max_len=4096))
    line: int = field(default=0, metadata=bounds(0, 10_000_000))
    module: str = field(default="", metadata=bounds(max_len=1024))


@dataclass(frozen=True)
class ThreadStack:
    """Frames innermost first, as py-spy prints them."""

    thread_id: int = field(default=0, metadata=U64)
    name: str = field(default="", metadata=bounds(max_len=1024))
    active: bool = True
    owns_gil: bool = False
    frames: list[Frame] = field(default_factory=list, metadata=bounds(max_items=MAX_FRAMES))


@dataclass(frozen=True)
class ProcessInfo:
    """One process in a rank's process tree."""

    pid: int = field(metadata=PID)
    ppid: int = field(default=0, metadata=PID)
    role: ProcessRole = ProcessRole.OTHER
    cmdline: str = field(default="", metadata=bounds(max_len=8192))
    state: str = field(default="", metadata=bounds(max_len=16))  # /proc/PID/stat state letter


@register
@dataclass(frozen=True)
class StackDump(Event):
    """py-spy stacks of one process of a rank, captured for ``capture_id`` (on-demand tracer)."""

    TYPE = "stack_dump"
    job: str = field(metadata=JOB_OR_NONE)
    node: str = field(metadata=NODE_OR_NONE)
    rank: int = field(metadata=RANK_OR_NONE)
    pid: int = field(metadata=PID)
    capture_id: str = field(metadata=NAME)
    ts_ms: int = field(metadata=TS_MS)
    role: ProcessRole = ProcessRole.MAIN
    round: int = field(default=0, metadata=bounds(0, 10_000))
    threads: list[ThreadStack] = field(default_factory=list, metadata=bounds(max_items=MAX_THREADS))
    #: the process tree the dump belongs to (the rank's main process and its children).
    process_tree: list[ProcessInfo] = field(default_factory=list, metadata=bounds(max_items=MAX_PROCESSES))
    #: py-spy's text output, kept for humans and postmortems.
    raw_text: str = field(default="", metadata=bounds(max_len=1_048_576))
    #: set when py-spy failed (process gone, permission): a missing stack is evidence too.
    error: str = field(default="", metadata=bounds(max_len=4096))


#: most entries one Flight Recorder event carries (PyTorch's ring buffer holds 2,000 by default;
#: the exporter keeps the newest ``flight_recorder.max_entries`` of a larger one).
MAX_FR_ENTRIES = 20_000
#: the triggers of a Flight Recorder dump.
FR_TRIGGERS = ("capture", "timeout")


@dataclass(frozen=True)
class FlightRecorderGroup:
    """A process group as a dump's ``pg_config`` names it (``ranks`` empty when not listed: gloo)."""

    name: str = field(default="", metadata=NAME)
    desc: str = field(default="", metadata=bounds(max_len=1024))
    ranks: list[int] = field(default_factory=list, metadata=RANKS)


@dataclass(frozen=True)
class FlightRecorderEntry:
    """One collective (or point-to-point operation) a rank's Flight Recorder recorded."""

    record_id: int = field(default=0, metadata=I64)
    group: str = field(default="", metadata=NAME)
    #: collective_seq_id, or p2p_seq_id for a point-to-point operation.
    seq: int = field(default=0, metadata=I64)
    p2p: bool = False
    op: str = field(default="", metadata=NAME)
    #: scheduled | started | completed.
    state: str = field(default="scheduled", metadata=bounds(max_len=32))
    #: tensor shapes, JSON (``[[4, 8]]``).
    input_sizes: str = field(default="[]", metadata=bounds(max_len=8192))
    output_sizes: str = field(default="[]", metadata=bounds(max_len=8192))
    created_ns: int = field(default=0, metadata=I64)
    #: 0: not completed.
    completed_ns: int = field(default=0, metadata=I64)
    retired: bool = False
    #: the Python frames that issued it, innermost first ("function (file:line)"), a few at most.
    frames: list[str] = field(default_factory=list, metadata=bounds(max_len=4096, max_items=64))


@register
@dataclass(frozen=True)
class FlightRecorderDump(Event):
    """One rank's PyTorch Flight Recorder dump: on a capture command (``trigger`` ``capture``, with
    the capture's id, beside its py-spy stacks) or written by PyTorch itself when a collective
    timed out (``timeout``, collected by the exporter).  The newest ``entries`` only (``dropped``
    says how many older ones did not fit); ``error`` set when the rank gave no dump: a rank that
    cannot dump is evidence too."""

    TYPE = "flight_recorder_dump"
    job: str = field(metadata=JOB_OR_NONE)
    node: str = field(metadata=NODE_OR_NONE)
    rank: int = field(metadata=RANK)
    ts_ms: int = field(metadata=TS_MS)
    capture_id: str = field(default="", metadata=NAME)
    trigger: str = field(default="capture", metadata=bounds(max_len=16))
    pid: int = field(default=0, metadata=PID)
    #: the dump's format version ("2.10"); empty with ``error``.
    fr_version: str = field(default="", metadata=bounds(max_len=32))
    groups: list[FlightRecorderGroup] = field(default_factory=list, metadata=bounds(max_items=65_536))
    entries: list[FlightRecorderEntry] = field(
        default_factory=list, metadata=bounds(max_items=MAX_FR_ENTRIES)
    )
    dropped: int = field(default=0, metadata=I64)
    error: str = field(default="", metadata=bounds(max_len=4096))

    def __post_init__(self) -> None:
        if self.trigger not in FR_TRIGGERS:
            raise ValueError(f"trigger {self.trigger!r} is not one of {FR_TRIGGERS}")
