"""A bounded on-disk spool of Kafka records: the exporter's write-ahead buffer.

Every record is appended here first and the delivery thread ships it from here, so there is one
path for normal operation and broker outages, a crash of the exporter loses nothing already
spooled, and sampling only ever waits for a local ``write()``.

Layout: ``<dir>/<seq>.seg`` (``<seq>.p<n>.seg`` for a priority ``n`` above the lowest) files of
frames ``crc32 | len(topic) | len(key) | len(value) | bytes`` (big-endian u32 headers).  The
newest segment of each priority is open for appends; :meth:`Spool.seal` closes them so the
delivery thread reads immutable files, oldest first, and deletes a file only when every record in
it is acknowledged.  A torn tail (crash mid-write) fails its CRC and ends the segment.  When the
spool exceeds ``max_bytes`` segments are dropped and counted, lowest priority first and oldest
first within one (see :class:`Spool`): under a long outage the newest data is the most useful,
and a kernel line more than any number of ordinary ones.

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


@dataclass
class _Open:
    """The open segment of one priority."""

    path: Path
    fh: BinaryIO
    bytes: int = 0
    records: int = 0
    dirty: bool = False  # frames not yet fsynced
    new_entry: bool = True  # its directory entry not yet fsynced


#: priorities of records (:meth:`Spool.append`): under the size bound the lowest go first.
ORDINARY, MATCHED, KERNEL = 0, 1, 2
PRIORITIES = (ORDINARY, MATCHED, KERNEL)


def segment_name(seq: int, priority: int) -> str:
    """``<seq>.seg`` (ordinary records: the name spools had before priorities), else
    ``<seq>.p<priority>.seg``."""
    return f"{seq:016d}.seg" if priority == ORDINARY else f"{seq:016d}.p{priority}.seg"


def _parse_name(path: Path) -> tuple[int, int] | None:
    """``(seq, priority)`` of a segment file name, None for anything else."""
    parts = path.name.split(".")
    if len(parts) == 2 and parts[0].isdigit():
        return int(parts[0]), ORDINARY
    if len(parts) == 3 and parts[0].isdigit() and parts[1][:1] == "p" and parts[1][1:].isdigit():
        return int(parts[0]), int(parts[1][1:])
    return None


class Spool:
    """Append-only segments with a total size bound, one open segment per priority; thread-safe.

    **Priorities.**  Under the size bound, segments are dropped lowest priority first and, within
    a priority, oldest first: a flood of ordinary records during a broker outage (a rank printing
    in a loop, the telemetry of a long outage) pushes out ordinary records only, while the
    kernel's own lines (:data:`KERNEL`) and lines a rule matches (:data:`MATCHED`) stay until
    nothing of lower priority is left (issue #38: the Xid line was lost under such a flood).  The
    open segment of a priority is dropped too once a higher one's would be the next to go.
    Delivery stays oldest sealed first, whatever the priority.
    """

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
        #: sealed segment path -> (bytes, records), in the order sealed (delivery order).
        self._sealed: dict[Path, tuple[int, int]] = {}
        #: the open segment of each priority that has one.
        self._open: dict[int, _Open] = {}
        self._busy: Path | None = None  # being delivered: never dropped under the bound
        self.dropped_records = 0
        #: records dropped under the bound, by priority.
        self.dropped_by_priority = dict.fromkeys(PRIORITIES, 0)
        #: called with the record count of every segment dropped under the bound (the metrics).
        self.on_drop: Callable[[int], None] | None = None
        self.appended = 0
        for tmp in self.dir.glob("*.tmp"):  # a rewrite cut short by a crash: the .seg is intact
            tmp.unlink(missing_ok=True)
        existing = sorted((named, p) for p in self.dir.glob("*.seg") if (named := _parse_name(p)) is not None)
        self._next = existing[-1][0][0] + 1 if existing else 0
        for _named, path in existing:  # from a previous run: all sealed now
            recs, _ = decode_frames(path.read_bytes())
            self._sealed[path] = (path.stat().st_size, len(recs))
        self._closing = threading.Event()
        self._flusher: threading.Thread | None = None
        if fsync_interval_s:  # None: never; 0: inside append()
            self._flusher = threading.Thread(target=self._flush_loop, name="spool-fsync", daemon=True)
            self._flusher.start()

    # -- writer side ---------------------------------------------------------------------------
    def append(self, rec: Record, priority: int = ORDINARY) -> None:
        """Spool one record; ``priority`` (one of :data:`PRIORITIES`) says how late it goes
        under the size bound."""
        if priority not in PRIORITIES:
            raise ValueError(f"spool priority {priority!r} is not one of {PRIORITIES}")
        frame = encode_frame(rec)
        full: tuple[BinaryIO, bool] | None = None
        with self._lock:
            seg = self._open.get(priority)
            if seg is None:
                path = self.dir / segment_name(self._next, priority)
                self._next += 1
                # Unbuffered: a frame is in the kernel's page cache once append() returns.
                seg = _Open(path, open(path, "ab", buffering=0))  # noqa: SIM115  (closed by seal)
                self._open[priority] = seg
            seg.fh.write(frame)
            seg.bytes += len(frame)
            seg.records += 1
            self.appended += 1
            seg.dirty = True
            if self.fsync_interval_s == 0:
                # Under the lock so that appends stay ordered with their syncs.
                self._fsync(seg.fh.fileno(), self._take_new_entry(seg))
                seg.dirty = False
            if seg.bytes >= self.segment_bytes:
                full = self._detach_locked(priority)
            dropped = self._enforce_bound_locked()
        if full is not None:
            self._finish(*full)
        for fh in dropped:
            fh.close()

    def sync(self) -> None:
        """fsync the frames appended to the open segments since the last sync (if any)."""
        todo = []
        with self._lock:
            for seg in self._open.values():
                if not seg.dirty:
                    continue
                # A duplicate descriptor stays valid if seal() closes the file meanwhile, so the
                # (slow) fsync runs outside the lock and appends never wait for it.
                todo.append((os.dup(seg.fh.fileno()), self._take_new_entry(seg)))
                seg.dirty = False
        for fd, new_entry in todo:
            try:
                self._fsync(fd, new_entry)
            finally:
                os.close(fd)

    def _flush_loop(self) -> None:
        assert self.fsync_interval_s
        while not self._closing.wait(self.fsync_interval_s):
            self.sync()

    @staticmethod
    def _take_new_entry(seg: _Open) -> bool:
        new, seg.new_entry = seg.new_entry, False
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

    def _detach_locked(self, priority: int) -> tuple[BinaryIO, bool] | None:
        """Seal the open segment of ``priority`` in the bookkeeping; :meth:`_finish` then syncs
        and closes the file without the lock (file, directory entry not yet synced?)."""
        seg = self._open.pop(priority, None)
        if seg is None:
            return None
        self._sealed[seg.path] = (seg.bytes, seg.records)
        return seg.fh, self._take_new_entry(seg)

    def _finish(self, fh: BinaryIO, new_entry: bool) -> None:
        # Even when no frame is dirty: an interval sync may still be running on its duplicate
        # descriptor, and seal() promises a durable segment when it returns.
        if self.fsync_interval_s is not None:
            self._fsync(fh.fileno(), new_entry)
        fh.close()

    def _victim_locked(self) -> tuple[Path, int, int, _Open | None] | None:
        """The segment to drop next: the lowest priority, then the oldest, of the sealed ones
        (not the one being delivered); an open segment only when a sealed one of a higher
        priority would go instead.  None: nothing may go (the bound is exceeded briefly)."""
        sealed = [(_priority(p), _seq(p), p) for p in self._sealed if p != self._busy]
        if not sealed:
            return None
        prio, _s, path = min(sealed)
        lower = [(pr, _seq(seg.path), pr) for pr, seg in self._open.items() if pr < prio]
        if lower:
            pr = min(lower)[2]
            seg = self._open[pr]
            return seg.path, seg.records, pr, seg
        _size, records = self._sealed[path]
        return path, records, prio, None

    def _enforce_bound_locked(self) -> list[BinaryIO]:
        """Drop segments until the spool fits ``max_bytes``; returns the files of open segments
        dropped (the caller closes them outside the lock)."""
        closed: list[BinaryIO] = []
        while self.total_bytes_locked() > self.max_bytes:
            victim = self._victim_locked()
            if victim is None:
                return closed  # only the busy segment and open ones: they may exceed it briefly
            path, records, priority, seg = victim
            if seg is not None:
                del self._open[priority]
                closed.append(seg.fh)
            else:
                del self._sealed[path]
            self.dropped_records += records
            self.dropped_by_priority[priority] += records
            if self.on_drop is not None:
                self.on_drop(records)
            log.warning(
                "spool full (%d bytes): dropped %d records of priority %d (%s)",
                self.max_bytes,
                records,
                priority,
                path.name,
            )
            # No directory fsync: a dropped or delivered segment that reappears after a crash is
            # re-sent, and every consumer deduplicates by event key.
            path.unlink(missing_ok=True)
        return closed

    def total_bytes_locked(self) -> int:
        return sum(seg.bytes for seg in self._open.values()) + sum(size for size, _ in self._sealed.values())

    # -- reader side ---------------------------------------------------------------------------
    def seal(self) -> None:
        """Close the open segments (if any), fsynced, so they can be delivered (oldest first)."""
        with self._lock:
            order = sorted(self._open, key=lambda pr: _seq(self._open[pr].path))
            detached = [d for pr in order if (d := self._detach_locked(pr)) is not None]
        for fh, new_entry in detached:
            self._finish(fh, new_entry)

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
            return sum(seg.records for seg in self._open.values()) + sum(r for _, r in self._sealed.values())

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


def _seq(path: Path) -> int:
    named = _parse_name(path)
    return named[0] if named is not None else -1


def _priority(path: Path) -> int:
    named = _parse_name(path)
    return named[1] if named is not None else ORDINARY
