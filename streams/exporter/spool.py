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
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
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


class Spool:
    """Append-only segments with a total size bound; thread-safe."""

    def __init__(
        self, directory: str | os.PathLike[str], max_bytes: int, segment_bytes: int = 1 << 20
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        #: sealed segment path -> (bytes, records), oldest first.
        self._sealed: dict[Path, tuple[int, int]] = {}
        self._active: Path | None = None
        self._fh: BinaryIO | None = None
        self._active_bytes = 0
        self._active_records = 0
        self._busy: Path | None = None  # being delivered: never dropped under the bound
        self.dropped_records = 0
        self.appended = 0
        existing = sorted(self.dir.glob("*.seg"), key=lambda p: int(p.stem))
        self._next = int(existing[-1].stem) + 1 if existing else 0
        for path in existing:  # from a previous run: all sealed now
            recs, _ = decode_frames(path.read_bytes())
            self._sealed[path] = (path.stat().st_size, len(recs))

    # -- writer side ---------------------------------------------------------------------------
    def append(self, rec: Record) -> None:
        frame = encode_frame(rec)
        with self._lock:
            if self._fh is None:
                self._active = self.dir / f"{self._next:016d}.seg"
                self._next += 1
                # Unbuffered: a frame is in the kernel's page cache once append() returns.
                self._fh = open(self._active, "ab", buffering=0)  # noqa: SIM115  (closed by seal)
                self._active_bytes = self._active_records = 0
            self._fh.write(frame)
            self._active_bytes += len(frame)
            self._active_records += 1
            self.appended += 1
            if self._active_bytes >= self.segment_bytes:
                self._seal_locked()
            self._enforce_bound_locked()

    def _seal_locked(self) -> None:
        if self._fh is None or self._active is None:
            return
        self._fh.close()
        self._sealed[self._active] = (self._active_bytes, self._active_records)
        self._fh = self._active = None
        self._active_bytes = self._active_records = 0

    def _enforce_bound_locked(self) -> None:
        while self.total_bytes_locked() > self.max_bytes:
            victim = next((p for p in self._sealed if p != self._busy), None)
            if victim is None:
                return  # only the active/busy segment is left: it may exceed the bound briefly
            _size, records = self._sealed.pop(victim)
            self.dropped_records += records
            log.warning(
                "spool full (%d bytes): dropped %d oldest records (%s)", self.max_bytes, records, victim.name
            )
            victim.unlink(missing_ok=True)

    def total_bytes_locked(self) -> int:
        return self._active_bytes + sum(size for size, _ in self._sealed.values())

    # -- reader side ---------------------------------------------------------------------------
    def seal(self) -> None:
        """Close the open segment (if any) so it can be delivered."""
        with self._lock:
            self._seal_locked()

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
        """Keep only ``recs`` in a segment (the unacknowledged rest when delivery gives up)."""
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(b"".join(encode_frame(r) for r in recs))
        with self._lock:
            os.replace(tmp, path)
            if path in self._sealed:
                self._sealed[path] = (path.stat().st_size, len(recs))

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

    def close(self) -> None:
        self.seal()
