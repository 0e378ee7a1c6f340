"""The one config of a warm node agent (:class:`AgentConfig`), loaded with
:func:`trainguard.schemas.config.load_config` (unknown keys are errors)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.schemas import names
from trainguard.schemas.limits import JOB, NODE, NODES
from trainguard.schemas.typecheck import bounds

#: the agent's default port: beside the stream workers' 9400, the exporter's 9401 and the action
#: service's 9402.
DEFAULT_PORT = 9403


@dataclass(frozen=True)
class AgentConfig:
    """Settings of ``trainguard agent`` (one command-line option per field)."""

    #: the TrainGuard job name; commands for other jobs are skipped.
    job: str = field(metadata=JOB)
    #: this machine's name, as the job's node lists name it.
    node: str = field(metadata=NODE)
    #: the training command: ``python SCRIPT ARGS...`` or ``python -m MODULE ARGS...`` (the zygote
    #: runs it in its forked children; anything else cannot be forked warm).
    command: list[str] = field(metadata=bounds(max_len=65_536, max_items=4096))
    #: ranks on every machine of the job (``LOCAL_WORLD_SIZE``).
    ranks_per_node: int = field(default=1, metadata=bounds(1, 4096))
    #: the local ranks this agent holds; empty = all of ``range(ranks_per_node)`` (one agent per
    #: machine).  ``trainguard launch --agent`` runs one agent per Slurm task, holding its own.
    local_ranks: list[int] = field(default_factory=list, metadata=bounds(0, 4095, max_items=4096))
    #: modules the zygote imports before any fork (torch, the model's modules).  Never anything that
    #: initialises CUDA, NCCL or a process group: the zygote refuses to serve if one did.
    preload: list[str] = field(default_factory=list, metadata=bounds(max_len=256, max_items=1024))
    #: where the agent writes ``state.json``, ``dead-letters.jsonl`` and the ranks' logs.
    state_dir: str = field(default="/run/trainguard/agent", metadata=bounds(max_len=4096))
    #: the HTTP endpoint (``GET /state``, ``POST /command``): every interface, so an executor (or a
    #: Kubernetes probe) reaches it from elsewhere; commands must be signed, the state is no secret.
    host: str = field(default="0.0.0.0", metadata=bounds(max_len=255))
    #: 0 = a free port (written to ``state.json``).
    port: int = field(default=DEFAULT_PORT, metadata=bounds(0, 65535))
    #: also follow the Kafka command topic (the exporters' signed path); off: HTTP only.
    kafka: bool = True
    #: a code version ``V`` lives in ``code_root/V`` ("" = no hot updates: the current directory).
    code_root: str = field(default="", metadata=bounds(max_len=4096))
    #: the code version the job starts on ("" = the current directory).
    code_version: str = field(default="", metadata=bounds(max_len=128))
    #: the first world: its nodes in rank order (empty = this agent starts as a standby), generation,
    #: rendezvous address and port.
    nodes: list[str] = field(default_factory=list, metadata=NODES)
    generation: int = field(default=0, metadata=bounds(0, 2**62))
    master_addr: str = field(default="", metadata=bounds(max_len=255))
    master_port: int = field(default=29500, metadata=bounds(1, 65535))
    #: a stopped rank gets SIGTERM, then SIGKILL after this.
    stop_grace_s: float = field(default=5.0, metadata=bounds(0, 600))
    #: how long a zygote may take to import its preload list before it is given up on.
    zygote_timeout_s: float = field(default=300.0, metadata=bounds(1, 3600))
    #: older commands are skipped (a restarted agent must not replay yesterday's restart).
    max_age_s: float = field(default=300.0, metadata=bounds(1, 86_400))
    #: the node exporter's reporter socket ("" = ``$TRAINGUARD_REPORTER_SOCKET`` or
    #: ``/run/trainguard/reporter.sock``), where the ranks are registered and their exits reported.
    reporter_socket: str = field(default="", metadata=bounds(max_len=4096))
    #: how often the ranks are registered again (an exporter restarted later learns them).
    register_interval_s: float = field(default=10.0, metadata=bounds(0.5, 3600))

    def __post_init__(self) -> None:
        for rule, value in ((names.JOB, self.job), (names.NODE, self.node)):
            why = rule.problem(value)
            if why is not None:
                raise ValueError(why)
        if not self.command:
            raise ValueError("command: give the training command")
        bad = [r for r in self.local_ranks if r >= self.ranks_per_node]
        if bad:
            raise ValueError(f"local_ranks {bad} not below ranks_per_node {self.ranks_per_node}")
        if self.code_version and not self.code_root:
            raise ValueError("code_version needs code_root (where the versions live)")

    @property
    def held(self) -> list[int]:
        """The local ranks this agent runs."""
        return sorted(set(self.local_ranks)) or list(range(self.ranks_per_node))
