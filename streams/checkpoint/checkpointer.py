"""Every-step asynchronous checkpoints with a cross-parallel-group peer backup (ByteRobust §6.3).

After step ``S`` the loop calls :meth:`Checkpointer.save`: model, optimizer and data position
are copied into host memory (a dual buffer, so the copy allocates nothing once warm) and the
loop goes on.  A writer thread then writes the snapshot as the rank's shard (:mod:`.state`: no
pickling, the tensors' own bytes) and its manifest on the local disk; a sender thread sends the
newest written shard (``sendfile`` from the page cache) to the backup rank's server over TCP
(:mod:`.transport`); that rank shares no TP, PP or DP group with this one (:mod:`.peers`).

The loop waits only when both buffers are still being written to the local disk (or, with
``when_behind="skip"``, skips that step's checkpoint and counts it), never for the peer: a slow
or dead peer makes backups older (superseded shards are counted as skipped), not steps slower.

Nothing the threads do raises into the loop: a failed local write or backup is counted in
:meth:`Checkpointer.stats` and logged; after a failed backup the peer is left alone for
``peer_retry_s`` (counted as skipped), so a dead peer costs one timeout in the sender thread,
not one per step.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.streams.checkpoint.config import CheckpointConfig, job_key
from trainguard.streams.checkpoint.peers import backup_rank
from trainguard.streams.checkpoint.restore import RestoreResult, restore_state
from trainguard.streams.checkpoint.state import encode, snapshot_into, torch_module
from trainguard.streams.checkpoint.store import Manifest, Parts, ShardStore, digest
from trainguard.streams.checkpoint.transport import BackupServer, send_backup, split_address

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointStats:
    """Counters of one rank's checkpointer: what was saved, what failed, what the loop paid."""

    snapshots: int = 0
    #: own shards complete (manifest written) on the local disk, and the newest such step.
    written: int = 0
    last_written: int = -1
    #: backups the peer confirmed (checksum verified there), and the newest such step.
    backed_up: int = 0
    last_backed_up: int = -1
    write_failures: int = 0
    snapshot_failures: int = 0
    backup_failures: int = 0
    #: checkpoint steps not saved because both buffers were busy (``when_behind="skip"``).
    skipped_busy: int = 0
    #: backups not attempted: no peer known, the peer in its retry pause after a failure, or the
    #: shard superseded by a newer one before the sender got to it.
    backups_skipped: int = 0
    #: seconds the loop spent copying state to host memory, and waiting for a free buffer.
    snapshot_s: float = 0.0
    blocked_s: float = 0.0
    #: requests this rank's backup server refused (corrupt backups, hostile headers).
    server_refused: int = 0
    last_error: str = ""


class Checkpointer:
    """One rank's every-step checkpoints: local shard, peer backup, restore.

    ``start()`` opens this rank's backup server; ``connect(addresses)`` gives every rank's
    server address (``None``: gathered with ``torch.distributed``); then ``restore(...)`` once
    and ``save(step, ...)`` after every optimizer step; ``close()`` at the end.
    """

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.store = ShardStore(
            config.directory, config.job, config.rank, fsync=config.fsync, key=job_key(config)
        )
        self.peer_rank = backup_rank(config)
        self._server: BackupServer | None = None
        self._addresses: list[str] = []
        self._cond = threading.Condition()
        self._buffers: list[Any] = [None, None]
        self._busy = [False, False]
        self._next = 0
        self._queue: deque[tuple[int, int]] = deque()
        self._writing = False
        #: the newest locally written shard not yet sent to the peer (a newer one replaces it).
        self._to_send: tuple[Manifest, Path] | None = None
        self._sending = False
        self._closing = False
        self._peer_pause_until = 0.0
        self._c: dict[str, Any] = dict(CheckpointStats().__dict__)
        self._writer: threading.Thread | None = None
        self._sender: threading.Thread | None = None

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> str:
        """Open the backup server and the writer thread; returns this rank's ``host:port``."""
        if self._server is None:
            c = self.config
            self._server = BackupServer(
                self.store, c.listen_host, c.listen_port,
                max_bytes=c.max_shard_bytes, keep=c.keep, timeout_s=c.io_timeout_s,
            )  # fmt: skip
            self._writer = threading.Thread(
                target=self._write_loop, name=f"ckpt-writer-{c.rank}", daemon=True
            )
            self._writer.start()
            self._sender = threading.Thread(target=self._send_loop, name=f"ckpt-sender-{c.rank}", daemon=True)
            self._sender.start()
        return self.address

    @property
    def address(self) -> str:
        if self._server is None:
            raise RuntimeError("Checkpointer.start() first")
        c = self.config
        host = c.advertise_host or (c.listen_host if c.listen_host not in ("", "0.0.0.0", "::") else "")
        return f"{host or socket.gethostname()}:{self._server.port}"

    def connect(self, addresses: Sequence[str] | None = None) -> list[str]:
        """Set every current rank's server address (index = rank); None gathers them over the
        initialised default ``torch.distributed`` process group."""
        if addresses is None:
            dist = sys.modules.get("torch.distributed")
            if dist is None or not dist.is_initialized():
                raise RuntimeError("connect(None) needs an initialised torch.distributed process group")
            gathered: list[Any] = [None] * self.config.world_size
            dist.all_gather_object(gathered, self.address)
            addresses = [str(a) for a in gathered]
        if len(addresses) != self.config.world_size:
            raise ValueError(f"{len(addresses)} addresses for a job of {self.config.world_size} ranks")
        for a in addresses:
            split_address(a)
        self._addresses = list(addresses)
        return self._addresses

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the queued writes and backups (up to ``timeout_s``), then stop threads and server."""
        self.flush(timeout_s)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for thread in (self._writer, self._sender):
            if thread is not None:
                thread.join(timeout_s)
        if self._server is not None:
            self._server.close()

    # --- the loop's side --------------------------------------------------------------------

    def save(
        self, step: int, model: Any, optimizer: Any = None, data_position: Any = None, extra: Any = None
    ) -> bool:
        """Snapshot the state after ``step`` and queue it; False when ``step`` is not a
        checkpoint step, or was skipped (``when_behind="skip"``) or the snapshot failed (both
        counted).  Never raises for a failed write."""
        if step % self.config.every:
            return False
        if self._writer is None:
            raise RuntimeError("Checkpointer.start() first")
        t0 = time.perf_counter()
        with self._cond:
            idx = self._next
            if self._busy[idx] and self.config.when_behind == "skip":
                self._c["skipped_busy"] += 1
                return False
            while self._busy[idx]:  # the writer still writes the snapshot before last to disk
                self._cond.wait()
        t1 = time.perf_counter()
        try:
            live = {
                "step": step,
                "model": model.state_dict(),
                "optim": optimizer.state_dict() if optimizer is not None else None,
                "data_position": data_position.state_dict() if data_position is not None else None,
                "extra": extra,
            }
            self._buffers[idx] = snapshot_into(live, self._buffers[idx], torch_module().Tensor)
        except Exception as exc:
            self._count(snapshot_failures=1, last_error=f"snapshot of step {step}: {exc}")
            log.exception("checkpoint snapshot of step %d failed", step)
            return False
        t2 = time.perf_counter()
        with self._cond:
            self._busy[idx] = True
            self._next = 1 - idx
            self._queue.append((step, idx))
            self._c["snapshots"] += 1
            self._c["blocked_s"] += t1 - t0
            self._c["snapshot_s"] += t2 - t1
            self._cond.notify_all()
        return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued snapshot is written and backed up (or failed); False on timeout."""

        def idle() -> bool:
            return not (self._queue or self._writing or self._to_send or self._sending)

        with self._cond:
            return self._cond.wait_for(idle, timeout_s)

    def restore(
        self, model: Any, optimizer: Any = None, data_position: Any = None, *, at_most: int | None = None
    ) -> RestoreResult:
        """Load the newest step complete on the job's current machines into the given objects."""
        own = self._addresses[self.config.rank] if self._addresses else ""
        result = restore_state(self.config, self.store, self._addresses, own, at_most)
        if result.step is not None:
            st = result.state
            model.load_state_dict(st["model"])
            if optimizer is not None and st.get("optim") is not None:
                optimizer.load_state_dict(st["optim"])
            if data_position is not None and st.get("data_position") is not None:
                data_position.load_state_dict(st["data_position"])
        for reason in result.reasons:
            log.warning("checkpoint restore of rank %d: %s", self.config.rank, reason)
        return result

    def stats(self) -> CheckpointStats:
        with self._cond:
            refused = self._server.refused if self._server else 0
            return CheckpointStats(**{**self._c, "server_refused": refused})

    # --- the writer thread ------------------------------------------------------------------

    def _count(self, **delta: Any) -> None:
        with self._cond:
            for k, v in delta.items():
                self._c[k] = v if isinstance(v, str) else self._c[k] + v

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                step, idx = self._queue.popleft()
                self._writing = True
            try:
                self._write(step, idx)
            except Exception as exc:  # the thread must outlive any one bad step
                self._count(write_failures=1, last_error=f"step {step}: {exc}")
                log.exception("checkpoint of step %d failed", step)
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _write(self, step: int, idx: int) -> None:
        c = self.config
        try:
            # Zero-copy views of the snapshot: the buffer stays busy until the shard is on the
            # local disk, and only then may the loop refill it.
            parts = encode(self._buffers[idx], torch_module().Tensor)
            size, sha = digest(parts)
            m = Manifest(c.job, step, c.rank, c.world_size, size, sha).signed(self.store.key)
            try:
                path = self.store.put(m, parts, verify=False)  # m was just computed from these parts
                self.store.prune(c.rank, c.keep)
            except Exception as exc:
                self._count(write_failures=1, last_error=f"local shard of step {step}: {exc}")
                log.warning("checkpoint: local shard of step %d not written: %s", step, exc)
                self._backup(m, parts)  # no file to send from: from the buffer, still held
                return
        finally:
            with self._cond:
                self._busy[idx] = False
                self._cond.notify_all()
        with self._cond:
            self._c["written"] += 1
            self._c["last_written"] = step
            if self.peer_rank is not None:
                # The sender takes the newest shard: a slow or dead peer delays backups, never
                # the loop, and a shard superseded before it was sent is counted as skipped.
                if self._to_send is not None:
                    self._c["backups_skipped"] += 1
                self._to_send = (m, path)
                self._cond.notify_all()

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._to_send is not None or self._closing)
                if self._to_send is None:
                    return
                (m, path), self._to_send = self._to_send, None
                self._sending = True
            try:
                self._backup(m, path)
            finally:
                with self._cond:
                    self._sending = False
                    self._cond.notify_all()

    def _backup(self, m: Manifest, data: Parts | Path) -> None:
        c = self.config
        if self.peer_rank is None:
            return  # a one-machine job: there is no other machine to hold a backup
        if not self._addresses or time.monotonic() < self._peer_pause_until:
            self._count(backups_skipped=1)
            return
        address = self._addresses[self.peer_rank]
        try:
            send_backup(address, m, data, connect_s=c.connect_timeout_s, io_s=c.io_timeout_s)
            self._count(backed_up=1)
            with self._cond:
                self._c["last_backed_up"] = m.step
        except Exception as exc:
            self._peer_pause_until = time.monotonic() + c.peer_retry_s
            self._count(
                backup_failures=1, last_error=f"backup of step {m.step} to rank {self.peer_rank}: {exc}"
            )
            log.warning("checkpoint: backup of step %d to %s failed: %s", m.step, address, exc)
