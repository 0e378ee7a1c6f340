"""The backup transport: a small TCP server per rank, and its client calls.

Each rank's :class:`BackupServer` (a daemon thread in the training process) stores the backups
its peer sends and serves this machine's shards to a rank that restores elsewhere (a
replacement machine pulls its shard from the peer that holds the backup).  Nothing travels
through a filesystem both machines are assumed to share.

One request per connection: a 4-byte big-endian length, a JSON header, then (``put``) the
shard's bytes.  The reply has the same shape (``get`` carries the shard's bytes).

* ``{"op": "put", "manifest": {...}}`` + bytes -- store a backup (checked against the manifest);
* ``{"op": "list", "job": J}`` -- the verified shards on this machine, and the rejected ones;
* ``{"op": "get", "job": J, "step": S, "rank": R}`` -- one verified shard.

A peer's header is data, never a path: the job must be this server's, the step and rank
integers, the size under ``max_shard_bytes``; the bytes are hashed as they arrive into a
temporary file and renamed into place only if they match the manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import socketserver
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from trainguard.streams.checkpoint.store import Manifest, Parts, ShardError, ShardStore, check

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
#: the largest JSON header either side accepts (a list reply of many shards fits easily).
MAX_HEADER = 8 << 20
_CHUNK = 1 << 20


class TransportError(OSError):
    """A peer could not be reached, closed early, or answered with an error."""


class Unreachable(TransportError):
    """Nothing accepted the connection (the peer is gone, or its server not up yet)."""


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad address {address!r}: want host:port")
    return host.strip("[]"), int(port)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), _CHUNK))
        if not chunk:
            raise TransportError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


@dataclass(frozen=True)
class FileBody:
    """A payload sent from an open file with ``sendfile`` (no copy through Python)."""

    file: BinaryIO
    size: int


def _send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes | Parts | FileBody = b"") -> None:
    raw = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)
    if isinstance(payload, FileBody):
        if sock.sendfile(payload.file, 0, payload.size) != payload.size:
            raise TransportError("the shard file is shorter than its manifest")
        return
    for part in [payload] if isinstance(payload, bytes) else payload:
        sock.sendall(part)


def _recv_header(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_HEADER:
        raise TransportError(f"header of {n} bytes exceeds {MAX_HEADER}")
    header = json.loads(_recv_exact(sock, n))
    if not isinstance(header, dict):
        raise TransportError("header is not a JSON object")
    return header


class BackupServer:
    """Serves one rank's :class:`ShardStore` over TCP on a daemon thread."""

    def __init__(
        self, store: ShardStore, host: str, port: int, *, max_bytes: int, keep: int, timeout_s: float
    ):
        self.store, self.max_bytes, self.keep, self.timeout_s = store, max_bytes, keep, timeout_s
        #: refused or failed requests (a corrupt backup, a hostile header, a dropped connection).
        self.refused = 0
        self.last_error = ""
        self._lock = threading.Lock()
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer((host, port), Handler, bind_and_activate=True)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            args=(0.1,),
            name=f"ckpt-backup-server-{store.holder}",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(self.timeout_s)
        try:
            header = _recv_header(sock)
            op = header.get("op")
            if op == "put":
                self._put(sock, header)
            elif op == "list":
                self._check_job(header.get("job"))
                good, bad = self.store.inventory()
                _send_frame(sock, {"ok": True, "shards": [m.to_dict() for m in good], "rejected": bad})
            elif op == "get":
                self._get(sock, header)
            else:
                raise ShardError(f"unknown op {str(op)[:40]!r}")
        except Exception as exc:  # one bad request never stops the server
            with self._lock:
                self.refused += 1
                self.last_error = str(exc)[:500]
            log.warning("checkpoint server of rank %d refused a request: %s", self.store.holder, exc)
            with contextlib.suppress(OSError):
                _send_frame(sock, {"ok": False, "error": str(exc)[:500]})

    def _check_job(self, job: Any) -> None:
        if job != self.store.job:
            raise ShardError(f"this server holds job {self.store.job!r}, not {str(job)[:140]!r}")

    def _put(self, sock: socket.socket, header: dict[str, Any]) -> None:
        m = Manifest.from_dict(header.get("manifest"))
        self._check_job(m.job)
        if not m.authentic(self.store.key):  # before a byte of it is stored
            raise ShardError("backup's manifest mac does not verify: the sender lacks the job's key")
        if m.size > self.max_bytes:
            raise ShardError(f"shard of {m.size} bytes exceeds max_shard_bytes {self.max_bytes}")
        fd, name = tempfile.mkstemp(dir=self.store.dir, prefix=".recv-", suffix=".tmp")
        tmp = Path(name)
        try:
            digest, left = hashlib.sha256(), m.size
            buf = memoryview(bytearray(min(m.size, _CHUNK) or 1))  # one buffer, reused per chunk
            with os.fdopen(fd, "wb") as f:
                while left:
                    n = sock.recv_into(buf, min(left, len(buf)))
                    if not n:
                        raise ShardError(f"backup truncated: {m.size - left} of {m.size} bytes arrived")
                    digest.update(buf[:n])
                    f.write(buf[:n])
                    left -= n
            if digest.hexdigest() != m.sha256:
                raise ShardError("sha256 mismatch: the backup is corrupt or its manifest forged")
            self.store.commit_file(m, tmp)
        finally:
            tmp.unlink(missing_ok=True)
        self.store.prune(m.rank, self.keep)
        _send_frame(sock, {"ok": True})

    def _get(self, sock: socket.socket, header: dict[str, Any]) -> None:
        self._check_job(header.get("job"))
        step, rank = header.get("step"), header.get("rank")
        if type(step) is not int or type(rank) is not int or step < 0 or rank < 0:
            raise ShardError("get needs integer step and rank")
        m, data = self.store.read(rank, step)
        _send_frame(sock, {"ok": True, "manifest": m.to_dict()}, data)


def _call(
    address: str, header: dict[str, Any], payload: bytes | Parts | FileBody, *, connect_s: float, io_s: float
) -> tuple[socket.socket, dict[str, Any]]:
    host, port = split_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=connect_s)
    except OSError as exc:
        raise Unreachable(f"{address} unreachable: {exc}") from exc
    try:
        sock.settimeout(io_s)
        _send_frame(sock, header, payload)
        reply = _recv_header(sock)
    except BaseException:
        sock.close()
        raise
    if reply.get("ok") is not True:
        sock.close()
        raise TransportError(f"{address} refused: {str(reply.get('error'))[:500]}")
    return sock, reply


def send_backup(
    address: str, manifest: Manifest, data: Parts | Path, *, connect_s: float, io_s: float
) -> None:
    """Store a shard (its parts, or its file on the local disk) on the peer at ``address``;
    :class:`TransportError` unless the peer confirms it checked and stored it."""
    header = {"op": "put", "manifest": manifest.to_dict()}
    if isinstance(data, Path):
        # Opened before anything else: a prune of the file meanwhile leaves this handle readable.
        with data.open("rb") as f:
            sock, _ = _call(address, header, FileBody(f, manifest.size), connect_s=connect_s, io_s=io_s)
    else:
        sock, _ = _call(address, header, data, connect_s=connect_s, io_s=io_s)
    sock.close()


def list_shards(
    address: str, job: str, *, connect_s: float, io_s: float, key: bytes = b""
) -> tuple[list[Manifest], list[str]]:
    """The verified shards the machine at ``address`` holds (malformed entries, and ones whose mac
    does not verify under ``key``, are reported, not used)."""
    sock, reply = _call(address, {"op": "list", "job": job}, b"", connect_s=connect_s, io_s=io_s)
    sock.close()
    good, bad = [], [f"{address}: {str(r)[:300]}" for r in reply.get("rejected") or []]
    for raw in reply.get("shards") or []:
        try:
            m = Manifest.from_dict(raw)
            if not m.authentic(key):
                raise ShardError(f"step {m.step} rank {m.rank}: manifest mac does not verify")
            good.append(m)
        except ShardError as exc:
            bad.append(f"{address}: {exc}")
    return good, bad


def fetch_shard(
    address: str,
    job: str,
    step: int,
    rank: int,
    *,
    connect_s: float,
    io_s: float,
    max_bytes: int = 1 << 50,
    key: bytes = b"",
) -> tuple[Manifest, bytes]:
    """Pull (rank, step) from ``address`` and check it against its manifest (at most ``max_bytes``)."""
    header = {"op": "get", "job": job, "step": step, "rank": rank}
    sock, reply = _call(address, header, b"", connect_s=connect_s, io_s=io_s)
    try:
        m = Manifest.from_dict(reply.get("manifest"))
        if (m.job, m.step, m.rank) != (job, step, rank):
            raise ShardError(f"{address} sent another shard than asked for")
        if m.size > max_bytes:
            raise ShardError(f"{address} offers a shard of {m.size} bytes, over max_shard_bytes {max_bytes}")
        data = _recv_exact(sock, m.size)
        check(m, data, job, key)
        return m, data
    finally:
        sock.close()
