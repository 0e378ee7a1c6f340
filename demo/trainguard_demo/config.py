"""Settings of a demo training job and the on-disk layout of the simulated cluster.

:class:`LaunchSpec` is everything a rank needs to join a job (topology, machine names, rendezvous,
training and model settings); it round-trips through JSON (standby activation files) and through
the trainer's command line (:meth:`LaunchSpec.to_argv`).  :class:`ClusterPaths` names every file:

.. code-block:: text

    <cluster_dir>/code/current                          code version the job runs (see codever)
    <cluster_dir>/machines/<m>/faults.json              fault hooks polled by the machine's ranks
    <cluster_dir>/machines/<m>/ckpt/<job>/step-<S>/rank-<R>.pt (+ .json)    own shards
    <cluster_dir>/machines/<m>/ckpt/<job>/backup/step-<S>/rank-<R>.pt (+ .json)  peers' shards
    <cluster_dir>/machines/<m>/run/<job>/rank-<R>.json  per-step heartbeat / progress
    <cluster_dir>/machines/<m>/logs/<job>/rank-<R>.out|.err   the rank's stdout / stderr
    <cluster_dir>/machines/<m>/standby/<pool>/slot-<I>.json   a warm process, ready (see standby)
    <cluster_dir>/machines/<m>/standby/<pool>/activate.json   the job spec that wakes the pool

>>> spec = LaunchSpec(job="j", cluster_dir="/c", tp=2, pp=2, dp=1, ranks_per_machine=2, machines=["a", "b"])
>>> spec.world_size, spec.machine_of_rank(3), spec.ranks_on("b")
(4, 'b', [2, 3])
>>> LaunchSpec.from_json(spec.to_json()) == spec
True
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from trainguard.schemas.topology import JobTopology


@dataclass(frozen=True)
class ModelConfig:
    """Size of the tiny char-level GPT (small enough for 8 ranks on 2 CPU cores)."""

    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 128
    seq_len: int = 32


@dataclass(frozen=True)
class LaunchSpec:
    """One demo job: what every rank process is started with."""

    job: str
    cluster_dir: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ranks_per_machine: int = 1
    #: machine names, machine i holds ranks [i*rpm, (i+1)*rpm); empty: machine-0, machine-1, ...
    machines: list[str] = field(default_factory=list)
    steps: int = 100
    master_addr: str = "127.0.0.1"
    master_port: int = 29600
    #: resume from the latest complete checkpoint if there is one (else start at step 0).
    resume: bool = True
    micro_batch: int = 4
    #: GPipe micro-batches per step (each stage runs all forwards, then all backwards).
    microbatches: int = 2
    lr: float = 3e-3
    clip_norm: float = 1.0
    seed: int = 1234
    #: checkpoints kept on disk per rank (own shards and backups); older ones are pruned.
    keep_checkpoints: int = 3
    #: checkpoint every this many steps (1 = every step, ByteRobust's in-memory style; a baseline
    #: with remote storage checkpoints every ~50-100 steps and loses the work since the last one).
    checkpoint_every: int = 1
    #: raise ``FloatingPointError`` on a non-finite loss (Megatron's check_for_nan_in_loss_and_grad),
    #: so a NaN ends the job instead of training on; TrainGuard's job keeps False (it detects NaN
    #: from the step telemetry).
    nan_check: bool = False
    #: sleep after each step; slows the job down for a watchable live view (0 = full speed).
    step_delay_s: float = 0.0
    #: collective timeout: a rank blocked on a hung peer fails after this (NCCL's default ~10 min).
    pg_timeout_s: float = 600.0
    #: reporter socket; empty = $TRAINGUARD_REPORTER_SOCKET or the reporter's default.
    reporter_socket: str = ""
    #: batches through :class:`trainguard.streams.shadow_loader.ShadowLoader` (a warm standby loader takes
    #: over a hung one in place); False: one plain DataLoader, as the baseline job has.
    shadow_loader: bool = True
    #: DataLoader worker processes per loader (the shadow loader has two loaders).
    data_workers: int = 1
    #: append each step's batch hash to ``<batch_log>.rank-<R>`` (the exact-resume test).
    batch_log: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)

    def __post_init__(self) -> None:
        if self.data_workers < 1:
            raise ValueError(f"data_workers={self.data_workers} must be >= 1")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every={self.checkpoint_every} must be >= 1")
        names = self.machine_names()
        if len(set(names)) != len(names):
            raise ValueError(f"machine names must be distinct: {names}")
        if self.model.n_layers % self.pp:
            raise ValueError(f"n_layers={self.model.n_layers} must be divisible by pp={self.pp}")
        if self.model.n_heads % self.tp or self.model.d_ff % self.tp:
            raise ValueError(f"n_heads and d_ff must be divisible by tp={self.tp}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def topology(self) -> JobTopology:
        return JobTopology(
            job=self.job,
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            ranks_per_machine=self.ranks_per_machine,
            machines=list(self.machines),
        )

    def machine_names(self) -> list[str]:
        n = -(-self.world_size // self.ranks_per_machine)
        return list(self.machines) if self.machines else [f"machine-{i}" for i in range(n)]

    def machine_of_rank(self, rank: int) -> str:
        return self.machine_names()[rank // self.ranks_per_machine]

    def ranks_on(self, machine: str) -> list[int]:
        return self.topology().ranks_of_machine(self.machine_names().index(machine))

    def replace_machine(self, old: str, new: str) -> LaunchSpec:
        """The same job with machine ``old`` swapped for ``new`` (a standby taking its ranks)."""
        names = self.machine_names()
        names[names.index(old)] = new
        return replace(self, machines=names)

    def paths(self) -> ClusterPaths:
        return ClusterPaths(Path(self.cluster_dir))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LaunchSpec:
        raw: dict[str, Any] = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown job spec keys: {unknown}")
        raw["model"] = ModelConfig(**raw.get("model", {}))
        return cls(**raw)

    def to_argv(self, rank: int) -> list[str]:
        """Command-line flags of ``python -m trainguard_demo.trainer`` for ``rank``."""
        m = self.model
        argv = [
            "--cluster-dir", self.cluster_dir, "--job", self.job, "--rank", str(rank),
            "--world-size", str(self.world_size), "--tp", str(self.tp), "--pp", str(self.pp),
            "--dp", str(self.dp), "--ranks-per-machine", str(self.ranks_per_machine),
            "--machines", ",".join(self.machine_names()), "--machine", self.machine_of_rank(rank),
            "--master-addr", self.master_addr, "--master-port", str(self.master_port),
            "--steps", str(self.steps), "--micro-batch", str(self.micro_batch),
            "--microbatches", str(self.microbatches), "--lr", repr(self.lr),
            "--clip-norm", repr(self.clip_norm), "--seed", str(self.seed),
            "--keep-checkpoints", str(self.keep_checkpoints),
            "--checkpoint-every", str(self.checkpoint_every), "--step-delay", repr(self.step_delay_s),
            "--pg-timeout", repr(self.pg_timeout_s), "--d-model", str(m.d_model),
            "--heads", str(m.n_heads), "--layers", str(m.n_layers), "--d-ff", str(m.d_ff),
            "--seq-len", str(m.seq_len),
        ]  # fmt: skip
        if self.reporter_socket:
            argv += ["--reporter-socket", self.reporter_socket]
        if self.batch_log:
            argv += ["--batch-log", self.batch_log]
        argv += ["--data-workers", str(self.data_workers)]
        argv.append("--shadow-loader" if self.shadow_loader else "--no-shadow-loader")
        argv.append("--resume" if self.resume else "--no-resume")
        argv.append("--nan-check" if self.nan_check else "--no-nan-check")
        return argv


@dataclass(frozen=True)
class ClusterPaths:
    """Where each file of the simulated cluster lives (see the module docstring)."""

    root: Path

    def machine(self, name: str) -> Path:
        return self.root / "machines" / name

    def faults(self, machine: str) -> Path:
        return self.machine(machine) / "faults.json"

    def code_dir(self) -> Path:
        return self.root / "code"

    def ckpt_step(self, machine: str, job: str, step: int, backup: bool = False) -> Path:
        base = self.machine(machine) / "ckpt" / job
        return (base / "backup" if backup else base) / f"step-{step:08d}"

    def ckpt_root(self, machine: str, job: str, backup: bool = False) -> Path:
        base = self.machine(machine) / "ckpt" / job
        return base / "backup" if backup else base

    def progress(self, machine: str, job: str, rank: int) -> Path:
        return self.machine(machine) / "run" / job / f"rank-{rank:05d}.json"

    def log(self, machine: str, job: str, rank: int, stream: str) -> Path:
        return self.machine(machine) / "logs" / job / f"rank-{rank:05d}.{stream}"

    def pools(self, machine: str) -> Path:
        return self.machine(machine) / "standby"

    def pool(self, machine: str, pool: str) -> Path:
        return self.pools(machine) / pool

    def activation(self, machine: str, pool: str) -> Path:
        return self.pool(machine, pool) / "activate.json"


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write via a temp name and rename, so readers never see a torn file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # pid + thread id: a rank's checkpoint thread and main thread, or two injectors, never share it.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    if isinstance(data, str):
        tmp.write_text(data)
    else:
        tmp.write_bytes(data)
    tmp.replace(path)
