"""``reporter`` source: step telemetry and exits sent by training reporters on this node.

Training processes (:mod:`streams.reporter`) send encoded events, newline-separated, in Unix
datagrams; a receiver thread drains the socket continuously into a bounded in-memory queue and
each round publishes what is queued.  Events are validated with the wire codec
(garbage is counted and logged, never published) and stamped with this node's name and job when
the reporter left them empty.  Unix datagram sockets push back on a full queue (the sender sees
EAGAIN and counts a drop), so a slow exporter never blocks a training step.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import select
import socket
import threading
from pathlib import Path
from typing import Any

from schemas.base import Event
from schemas.codec import DecodeError, decode
from schemas.workload import LogLine, ProcessExit, TrainingStep
from streams.exporter.sources.base import SourceContext, register

log = logging.getLogger(__name__)

#: what a training process may send; anything else is refused.
ACCEPTED = (TrainingStep, ProcessExit, LogLine)
RCVBUF = 8 * 1024 * 1024


def bind_socket(path: Path) -> socket.socket:
    """A non-blocking datagram socket at ``path`` (a stale socket file is replaced)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    with contextlib.suppress(OSError):  # capped by net.core.rmem_max; best effort
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
    sock.bind(str(path))
    # Ranks may run as another user than the exporter: let them send.
    os.chmod(path, 0o666)
    sock.setblocking(False)
    return sock


def accept(raw: bytes, node: str, job: str) -> Event:
    """Decode one datagram; fill in node/job; raise DecodeError for anything not accepted."""
    event = decode(raw)
    if not isinstance(event, ACCEPTED):
        raise DecodeError("schema", f"{event.TYPE!r} is not accepted from a training reporter")
    changes: dict[str, Any] = {}
    if not event.node and node:
        changes["node"] = node
    if not event.job and job:
        changes["job"] = job
    return dataclasses.replace(event, **changes) if changes else event


class ReporterSource:
    name = "reporter"

    def __init__(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg.reporter
        self.path = Path(self.cfg.socket)
        self.sock: socket.socket | None = None
        self.rejected = 0
        #: events received but over the in-memory bound before a round took them.
        self.overflow = 0
        self._queue: collections.deque[bytes] = collections.deque()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        self.sock = bind_socket(self.path)
        self._thread = threading.Thread(target=self._receive, name="reporter-recv", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        # The kernel queues few datagrams per socket (net.unix.max_dgram_qlen, 10 on many hosts):
        # drain continuously here, not once per round, or ranks would see EAGAIN and drop steps.
        assert self.sock is not None
        while not self._closed.is_set():
            try:
                ready, _, _ = select.select([self.sock], [], [], 0.2)
                if not ready:
                    continue
                raw = self.sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return  # closed under us
            for part in raw.split(b"\n"):
                if not part:
                    continue
                if len(self._queue) >= self.cfg.max_per_round:
                    self.overflow += 1
                else:
                    self._queue.append(part)

    def collect(self) -> list[Event]:
        if self.sock is None:
            self._start()
        out: list[Event] = []
        while self._queue:
            raw = self._queue.popleft()
            try:
                out.append(accept(raw, self.ctx.node, self.ctx.job))
            except DecodeError as exc:
                self.rejected += 1
                log.warning("reporter event rejected (%d so far): %s", self.rejected, exc)
        if self.overflow:
            log.warning("reporter: %d events over the in-memory bound were dropped", self.overflow)
        return out

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(2.0)
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            with contextlib.suppress(OSError):
                self.path.unlink()


@register("reporter")
def _factory(ctx: SourceContext) -> ReporterSource:
    return ReporterSource(ctx)
