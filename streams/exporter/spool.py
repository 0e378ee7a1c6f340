"""A bounded on-disk spool of Kafka records: the exporter's write-ahead buffer.

Every record is appended here first and the delivery thread ships it from here, so there is one
path for normal operation and broker outages, a crash of the exporter loses nothing already
spooled, and sampling only ever waits for a local ``write()``.

Layout: ``<dir>/<seq>.seg`` files of frames ``crc32 | len(topic) | len(key) | len(value) | bytes``
(big-endian u32 headers).  The newest segment is open for appends; :meth:`Spool.seal` closes it so
the delivery thread reads immutable files, oldest first, and deletes a file only when every
record in it is acknowledged.  A torn tail (crash mid-write) fails its CRC and ends the segment.
When the spool exceeds ``max_bytes`` the oldest sealed segments are dropped and counted: under a
long outage the newest data is the most useful.

Durability: a frame is in the page cache once :meth:`Spool.append` returns; ``fsync_interval_s``
says when it reaches the disk, so that a node going down (an Xid that hangs the kernel, a power
cut) keeps its last telemetry.  A sealed segment is always fsynced, the open one every
``fsync_interval_s`` seconds by a background thread (appends never wait for it); ``0`` fsyncs
inside every append (nothing acknowledged is ever lost, at a disk flush per record) and ``None``
never fsyncs (the page cache only; benchmarks and tmpfs).  :meth:`Spool.rewrite` replaces a
segment atomically: temp file, fsync, rename, fsync of the directory.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">IIII")


@dataclass(frozen=True)
class Record:
    topic: str
    key: bytes | None
    value: bytes


def encode_frame(rec: Record) -> bytes:
    """One record as a frame (key None and b"" are both stored as empty)."""
    topic = rec.topic.encode()
    key = rec.key or b""
    body = topic + key + rec.value
    crc = zlib.crc32(struct.pack(">III", len(topic), len(key), len(rec.value)) + body)
    return _HEADER.pack(crc, len(topic), len(key), len(rec.value)) + body


def decode_frames(data: bytes) -> tuple[list[Record], int]:
    """Records of a segment and the byte count of the valid prefix (stops at a torn/corrupt frame).

    >>> blob = encode_frame(Record("t", b"k", b"v1")) + encode_frame(Record("t", None, b"v2"))
    >>> recs, n = decode_frames(blob + b"\\x00\\x01")
    >>> [r.value for r in recs], n == len(blob)
    ([b'v1', b'v2'], True)
    """
    out: list[Record] = []
    pos = 0
    while pos + _HEADER.size <= len(data):
        crc, lt, lk, lv = _HEADER.unpack_from(data, pos)
        end = pos + _HEADER.size + lt + lk + lv
        if end > len(data):
            break
        body = data[pos + _HEADER.size : end]
        if zlib.crc32(struct.pack(">III", lt, lk, lv) + body) != crc:
            break
        out.append(Record(body[:lt].decode(), body[lt : lt + lk] or None, body[lt + lk :]))
        pos = end
    return out, pos


def _fsync_dir(directory: Path) -> None:
    """Make new, renamed or removed names in ``directory`` durable (fsync of the file is not enough)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Spool:
    """Append-only segments with a total size bound; thread-safe."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int,
        segment_bytes: int = 1 << 20,
        fsync_interval_s: float | None = 1.0,
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.fsync_interval_s = fsync_interval_s
        self._lock = threading.Lock()
        #: sealed segment path -> (bytes, records), oldest first.
        self._sealed: dict[Path, tuple[int, int]] = {}
        self._active: Path | None = None
        self._fh: BinaryIO | None = None
        self._active_bytes = 0
        self._active_records = 0
        self._dirty = False  # the open segment has frames not yet fsynced
        self._new_entry = False  # the open segment's directory entry is not yet fsynced
        self._busy: Path | None = None  # being delivered: never dropped under the bound
        self.dropped_records = 0
        #: called with the record count of every segment dropped under the bound (the metrics).
        self.on_drop: Callable[[int], None] | None = None
        self.appended = 0
        for tmp in self.dir.glob("*.tmp"):  # a rewrite cut short by a crash: the .seg is intact
            tmp.unlink(missing_ok=True)
        existing = sorted(self.dir.glob("*.seg"), key=lambda p: int(p.stem))
        self._next = int(existing[-1].stem) + 1 if existing else 0
        for path in existing:  # from a previous run: all sealed now
            recs, _ = decode_frames(path.read_bytes())
            self._sealed[path] = (path.stat().st_size, len(recs))
        self._closing = threading.Event()
        self._flusher: threading.Thread | None = None
        if fsync_interval_s:  # None: never; 0: inside append()
            self._flusher = threading.Thread(target=self._flush_loop, name="spool-fsync", daemon=True)
            self._flusher.start()

    # -- writer side ---------------------------------------------------------------------------
    def append(self, rec: Record) -> None:
        frame = encode_frame(rec)
        full: tuple[BinaryIO, bool] | None = None
        with self._lock:
            if self._fh is None:
                self._active = self.dir / f"{self._next:016d}.seg"
                self._next += 1
                # Unbuffered: a frame is in the kernel's page cache once append() returns.
                self._fh = open(self._active, "ab", buffering=0)  # noqa: SIM115  (closed by seal)
                self._active_bytes = self._active_records = 0
                self._new_entry = True
            self._fh.write(frame)
            self._active_bytes += len(frame)
            self._active_records += 1
            self.appended += 1
            self._dirty = True
            if self.fsync_interval_s == 0:
                # Under the lock so that appends stay ordered with their syncs.
                self._fsync(self._fh.fileno(), self._take_new_entry_locked())
                self._dirty = False
            if self._active_bytes >= self.segment_bytes:
                full = self._detach_locked()
            self._enforce_bound_locked()
        if full is not None:
            self._finish(*full)

    def sync(self) -> None:
        """fsync the frames appended to the open segment since the last sync (if any)."""
        with self._lock:
            if self._fh is None or not self._dirty:
                return
            # A duplicate descriptor stays valid if seal() closes the file meanwhile, so the
            # (slow) fsync runs outside the lock and appends never wait for it.
            fd = os.dup(self._fh.fileno())
            self._dirty = False
            new_entry = self._take_new_entry_locked()
        try:
            self._fsync(fd, new_entry)
        finally:
            os.close(fd)

    def _flush_loop(self) -> None:
        assert self.fsync_interval_s
        while not self._closing.wait(self.fsync_interval_s):
            self.sync()

    def _take_new_entry_locked(self) -> bool:
        new, self._new_entry = self._new_entry, False
        return new

    def _fsync(self, fd: int, new_entry: bool) -> None:
        # An fsync error cannot be retried meaningfully (Linux drops the dirty pages); the
        # records are still delivered from the page cache, so log rather than fail sampling.
        try:
            os.fsync(fd)
            if new_entry:
                _fsync_dir(self.dir)
        except OSError as exc:
            log.warning("spool fsync failed: %s", exc)

    def _detach_locked(self) -> tuple[BinaryIO, bool] | None:
        """Seal the open segment's bookkeeping; :meth:`_finish` then syncs and closes the file
        without the lock (file, directory entry not yet synced?)."""
        if self._fh is None or self._active is None:
            return None
        detached = (self._fh, self._take_new_entry_locked())
        self._sealed[self._active] = (self._active_bytes, self._active_records)
        self._fh = self._active = None
        self._active_bytes = self._active_records = 0
        self._dirty = False
        return detached

    def _finish(self, fh: BinaryIO, new_entry: bool) -> None:
        # Even when no frame is dirty: an interval sync may still be running on its duplicate
        # descriptor, and seal() promises a durable segment when it returns.
        if self.fsync_interval_s is not None:
            self._fsync(fh.fileno(), new_entry)
        fh.close()

    def _enforce_bound_locked(self) -> None:
        while self.total_bytes_locked() > self.max_bytes:
            victim = next((p for p in self._sealed if p != self._busy), None)
            if victim is None:
                return  # only the active/busy segment is left: it may exceed the bound briefly
            _size, records = self._sealed.pop(victim)
            self.dropped_records += records
            if self.on_drop is not None:
                self.on_drop(records)
            log.warning(
                "spool full (%d bytes): dropped %d oldest records (%s)", self.max_bytes, records, victim.name
            )
            # No directory fsync: a dropped or delivered segment that reappears after a crash is
            # re-sent, and every consumer deduplicates by event key.
            victim.unlink(missing_ok=True)

    def total_bytes_locked(self) -> int:
        return self._active_bytes + sum(size for size, _ in self._sealed.values())

    # -- reader side ---------------------------------------------------------------------------
    def seal(self) -> None:
        """Close the open segment (if any), fsynced, so it can be delivered."""
        with self._lock:
            detached = self._detach_locked()
        if detached is not None:
            self._finish(*detached)

    def oldest(self) -> Path | None:
        """The oldest sealed segment, now marked busy (protected from the size bound)."""
        with self._lock:
            self._busy = next(iter(self._sealed), None)
            return self._busy

    def read(self, path: Path) -> list[Record]:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return []
        recs, valid = decode_frames(data)
        if valid != len(data):
            log.warning("spool segment %s: %d trailing bytes are torn; ignored", path.name, len(data) - valid)
        return recs

    def rewrite(self, path: Path, recs: list[Record]) -> None:
        """Keep only ``recs`` in a segment (the unacknowledged rest when delivery gives up).

        Atomic: a crash leaves either the old segment or the new one, never a truncated mix."""
        durable = self.fsync_interval_s is not None
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            fh.write(b"".join(encode_frame(r) for r in recs))
            if durable:
                fh.flush()
                os.fsync(fh.fileno())  # before the rename, or it could publish an empty file
        with self._lock:
            os.replace(tmp, path)
            if path in self._sealed:
                self._sealed[path] = (path.stat().st_size, len(recs))
        if durable:
            _fsync_dir(self.dir)  # the rename itself

    def remove(self, path: Path) -> None:
        """Delete a fully delivered segment."""
        with self._lock:
            self._sealed.pop(path, None)
            if self._busy == path:
                self._busy = None
            path.unlink(missing_ok=True)

    @property
    def pending_records(self) -> int:
        with self._lock:
            return self._active_records + sum(r for _, r in self._sealed.values())

    @property
    def pending_bytes(self) -> int:
        """Bytes of the segments on disk (the open one included)."""
        with self._lock:
            return self.total_bytes_locked()

    def close(self) -> None:
        """Seal (and so fsync) the open segment and stop the interval fsync thread."""
        self._closing.set()
        if self._flusher is not None:
            self._flusher.join()
        self.seal()
