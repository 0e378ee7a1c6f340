"""Restore: the newest step every rank can load, from the job's current machines.

Each rank asks every current rank's server (its own machine read directly) which verified
shards it holds, then walks the steps newest first: a step qualifies when every rank of the
job has a shard or a backup somewhere on those machines.  This rank's shard is taken from its
own disk, else pulled over TCP from the peer that holds the backup (a replacement machine
starts with an empty disk), and checked against its manifest.  A step it cannot use -- a rank
without any copy, a corrupt or vanished copy -- is passed over for an older complete one, and
:class:`RestoreResult` says which steps were passed over and why.

Every rank sees the same inventories, so every rank picks the same step; a job that wants a
guarantee all-reduces the MIN of the steps and calls again with ``at_most``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from trainguard.streams.checkpoint.config import CheckpointConfig
from trainguard.streams.checkpoint.state import decode
from trainguard.streams.checkpoint.store import Manifest, ShardError, ShardStore
from trainguard.streams.checkpoint.transport import TransportError, Unreachable, fetch_shard, list_shards

LOCAL = "local"


@dataclass(frozen=True)
class RestoreResult:
    """What a restore did; ``step`` is None when no complete step exists (start from scratch)."""

    step: int | None
    #: where this rank's shard came from: ``local`` or the peer's ``host:port``.
    source: str = ""
    #: the newest step any copy was seen for; > ``step`` means an older step was used.
    newest_seen: int | None = None
    #: each step passed over, and every copy rejected, with the reason.
    reasons: tuple[str, ...] = ()
    #: servers that could not be reached within ``restore_wait_s``.
    unreachable: tuple[str, ...] = ()
    seconds: float = 0.0
    #: the training state loaded (``model``, ``optim``, ``data_position``, ``extra``); not compared.
    state: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def fell_back(self) -> bool:
        """True when a newer step was seen but could not be used."""
        return self.step is not None and self.newest_seen is not None and self.step < self.newest_seen


def _inventory(
    cfg: CheckpointConfig, store: ShardStore, addresses: list[str], own: str
) -> tuple[dict[int, dict[int, list[str]]], list[str], list[str]]:
    """step -> rank -> sources holding a verified copy; rejected copies; unreachable servers."""
    found: dict[int, dict[int, list[str]]] = {}
    rejected: list[str] = []
    unreachable: list[str] = []

    def add(shards: list[Manifest], source: str) -> None:
        for m in shards:
            if m.world_size == cfg.world_size:
                found.setdefault(m.step, {}).setdefault(m.rank, []).append(source)
            else:
                rejected.append(f"{source}: step {m.step} rank {m.rank} is of a {m.world_size}-rank job")

    good, bad = store.inventory()
    add(good, LOCAL)
    rejected += [f"{LOCAL}: {b}" for b in bad]
    deadline = time.monotonic() + cfg.restore_wait_s
    for address in dict.fromkeys(a for a in addresses if a != own):
        while True:
            try:
                good, bad = list_shards(
                    address, cfg.job, connect_s=cfg.connect_timeout_s, io_s=cfg.io_timeout_s, key=store.key
                )
                add(good, address)
                rejected += bad
                break
            except Unreachable:
                if time.monotonic() < deadline:
                    time.sleep(0.1)  # a restarting rank's server may not listen yet
                    continue
                unreachable.append(address)
                break
            except (TransportError, OSError, ValueError) as exc:
                rejected.append(f"{address}: list failed: {exc}")
                break
    return found, rejected, unreachable


def _load_own(
    cfg: CheckpointConfig, store: ShardStore, step: int, sources: list[str], reasons: list[str]
) -> tuple[str, dict[str, Any]] | None:
    """This rank's shard of ``step``: own disk first, then each peer; None if no copy loads."""
    for source in sorted(sources, key=lambda s: s != LOCAL):
        try:
            if source == LOCAL:
                _, data = store.read(cfg.rank, step)
            else:
                _, data = fetch_shard(
                    source, cfg.job, step, cfg.rank, connect_s=cfg.connect_timeout_s,
                    io_s=cfg.io_timeout_s, max_bytes=cfg.max_shard_bytes, key=store.key,
                )  # fmt: skip
            return source, decode(data)
        except (ShardError, TransportError, OSError, ValueError, RuntimeError) as exc:
            reasons.append(f"step {step}: rank {cfg.rank}'s copy on {source} unusable: {exc}")
    return None


def restore_state(
    cfg: CheckpointConfig, store: ShardStore, addresses: list[str], own: str, at_most: int | None = None
) -> RestoreResult:
    """Find and load this rank's state of the newest step complete on the current machines."""
    t0 = time.perf_counter()
    found, reasons, unreachable = _inventory(cfg, store, addresses, own)
    newest = max(found, default=None)
    everyone = set(range(cfg.world_size))
    for step in sorted(found, reverse=True):
        if at_most is not None and step > at_most:
            continue
        missing = sorted(everyone - set(found[step]))
        if missing:
            shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
            reasons.append(
                f"step {step}: no valid shard or backup of rank(s) {shown} on the current machines"
            )
            continue
        loaded = _load_own(cfg, store, step, found[step][cfg.rank], reasons)
        if loaded is None:
            continue
        source, state = loaded
        return RestoreResult(
            step=step, source=source, newest_seen=newest, reasons=tuple(reasons),
            unreachable=tuple(unreachable), seconds=time.perf_counter() - t0, state=state,
        )  # fmt: skip
    return RestoreResult(
        step=None, newest_seen=newest, reasons=tuple(reasons), unreachable=tuple(unreachable),
        seconds=time.perf_counter() - t0,
    )  # fmt: skip
