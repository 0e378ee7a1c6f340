"""``reporter`` source: step telemetry and exits sent by training reporters on this node.

Training processes (:mod:`streams.reporter`) send one encoded event per datagram to a Unix
datagram socket; each round drains it without waiting.  Events are validated with the wire codec
(garbage is counted and logged, never published) and stamped with this node's name and job when
the reporter left them empty.  Unix datagram sockets push back on a full queue (the sender sees
EAGAIN and counts a drop), so a slow exporter never blocks a training step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
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

    def collect(self) -> list[Event]:
        if self.sock is None:
            self.sock = bind_socket(self.path)
        out: list[Event] = []
        while len(out) < self.cfg.max_per_round:
            try:
                raw = self.sock.recv(1 << 20)
            except BlockingIOError:
                break
            try:
                out.append(accept(raw, self.ctx.node, self.ctx.job))
            except DecodeError as exc:
                self.rejected += 1
                log.warning("reporter datagram rejected (%d so far): %s", self.rejected, exc)
        return out

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            with contextlib.suppress(OSError):
                self.path.unlink()


@register("reporter")
def _factory(ctx: SourceContext) -> ReporterSource:
    return ReporterSource(ctx)
