"""The one settings dataclass of the every-step checkpointer (:class:`CheckpointConfig`)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

from trainguard.schemas.limits import JOB
from trainguard.schemas.typecheck import bounds


@dataclass(frozen=True)
class CheckpointConfig:
    """Settings of :class:`~trainguard.streams.checkpoint.Checkpointer`.

    Built with ``trainguard.schemas.config.load_config`` (unknown keys are errors).  The peers'
    addresses are not settings: they are known only once every rank's backup server listens, so
    they are given to :meth:`Checkpointer.connect`.

    >>> from trainguard.schemas.config import load_config
    >>> load_config(CheckpointConfig, {"job": "j", "directory": "/tmp/ck", "dp": 2}).world_size
    2
    """

    #: the job's name (one checkpoint folder per job; a backup for another job is refused).
    job: str = field(metadata=JOB)
    #: this machine's local checkpoint folder (its disk; never a filesystem shared between machines).
    directory: str = field(metadata=bounds(max_len=4096))
    #: this process's global rank.
    rank: int = field(default=0, metadata=bounds(0, 1 << 20))
    #: the job's layout: the backup peer is a rank sharing none of these groups (§6.3).
    tp: int = field(default=1, metadata=bounds(1, 1 << 20))
    pp: int = field(default=1, metadata=bounds(1, 1 << 20))
    dp: int = field(default=1, metadata=bounds(1, 1 << 20))
    ranks_per_machine: int = field(default=8, metadata=bounds(1, 1 << 12))
    order: str = field(default="tp-dp-pp", metadata=bounds(max_len=8))
    #: checkpoint every this many steps (1: every step, as ByteRobust does).
    every: int = field(default=1, metadata=bounds(1, 1 << 30))
    #: complete checkpoints kept per rank (own shards and held backups alike).  At least 2: while
    #: step S is being written, S - every is the newest complete one and must survive.
    keep: int = field(default=2, metadata=bounds(2, 1000))
    #: the backup server listens here (port 0: any free port; :attr:`Checkpointer.address` says which).
    listen_host: str = field(default="0.0.0.0", metadata=bounds(max_len=255))
    listen_port: int = field(default=0, metadata=bounds(0, 65535))
    #: the host name the peers reach this server by (empty: this machine's host name).
    advertise_host: str = field(default="", metadata=bounds(max_len=255))
    #: -1: the planning code picks the backup rank; otherwise that rank (tests, unusual layouts).
    backup_rank: int = field(default=-1, metadata=bounds(-1, 1 << 20))
    #: TCP connect and per-operation timeouts: a dead peer costs at most this, in the writer thread.
    connect_timeout_s: float = field(default=2.0, metadata=bounds(0.01, 3600))
    io_timeout_s: float = field(default=60.0, metadata=bounds(0.01, 86400))
    #: after a failed backup, skip backups for this long (counted), so a dead peer is not
    #: re-dialled every step while the writer thread falls behind.
    peer_retry_s: float = field(default=10.0, metadata=bounds(0.0, 86400))
    #: restore waits this long for the other ranks' servers to come up before calling them gone.
    restore_wait_s: float = field(default=30.0, metadata=bounds(0.0, 86400))
    #: when the writer is still busy with both host buffers at a checkpoint step: ``wait`` (the
    #: loop waits, so every checkpoint step is saved; ByteRobust's integrity rule) or ``skip``
    #: (that step is not checkpointed, counted in ``skipped_busy``: the loop never waits on I/O).
    when_behind: str = field(default="wait", metadata=bounds(max_len=8))
    #: the largest shard a server accepts from a peer (a bound on what a hostile peer can fill).
    max_shard_bytes: int = field(default=64 << 30, metadata=bounds(1, 1 << 50))
    #: fsync each shard before its manifest.  Off by default: a dead *process* loses nothing
    #: (the page cache survives it) and a dead *machine* is restored from the peer's backup.
    fsync: bool = False
    #: the environment variable holding the job's checkpoint key (any string, the same on every
    #: rank and across the job's restarts: e.g. ``openssl rand -hex 32`` exported by the batch
    #: script, or a Kubernetes Secret).  Every manifest carries an HMAC under it: a host that can
    #: reach a backup port but lacks the key cannot plant a shard that a restore would load.
    key_env: str = field(default="TRAINGUARD_CHECKPOINT_KEY", metadata=bounds(max_len=255))
    #: refuse to start without a key.  False: manifests carry no mac, and anyone who can reach a
    #: rank's backup port can store a shard there (a trusted network only).
    require_key: bool = True

    def __post_init__(self) -> None:
        if sorted(self.order.split("-")) != ["dp", "pp", "tp"]:
            raise ValueError(f"order {self.order!r} must be a permutation of tp, dp, pp")
        if self.when_behind not in ("wait", "skip"):
            raise ValueError(f"when_behind must be 'wait' or 'skip', not {self.when_behind!r}")
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} outside a job of {self.world_size} ranks")
        if self.backup_rank >= self.world_size:
            raise ValueError(f"backup_rank {self.backup_rank} outside a job of {self.world_size} ranks")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


def job_key(config: CheckpointConfig) -> bytes:
    """The job's checkpoint key from ``config.key_env`` (hashed to 32 bytes); ``b""`` when the
    job runs without one.  :class:`ValueError` when a key is required and the variable is unset."""
    raw = os.environ.get(config.key_env, "")
    if raw:
        return hashlib.sha256(raw.encode()).digest()
    if config.require_key:
        raise ValueError(
            f"checkpoints need the job's key in ${config.key_env} (the same value on every rank, e.g. "
            "`export TRAINGUARD_CHECKPOINT_KEY=$(openssl rand -hex 32)` in the batch script), or "
            "require_key: false on a trusted network"
        )
    return b""
