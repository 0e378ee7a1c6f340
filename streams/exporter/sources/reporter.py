"""``reporter`` source: step telemetry and exits sent by training reporters on this node.

Training processes (:mod:`trainguard.streams.reporter`) send encoded events, newline-separated, in Unix
datagrams; a receiver thread drains the socket continuously into a bounded in-memory queue and
each round publishes what is queued.  Unix datagram sockets push back on a full queue (the sender
sees EAGAIN and counts a drop), so a slow exporter never blocks a training step.

Who may send, and for which job.  The socket is ``socket_mode`` (0660: owner and group) and
``socket_group`` (ranks running as another user in that group can send).  The job of an event
comes from *who sent it*, not from what it says: every datagram carries its sender's
kernel-verified (pid, uid, gid), datagrams from uids not in ``allowed_uids`` are refused, and an
event is bound to ``job_by_uid[uid]`` if mapped, else to the exporter's own job if set; an event
claiming another job is refused.  Only with neither does the sender's job stand.  Refusals are
counted per reason (:data:`REASONS`) and logged with the sender's pid and uid; nothing refused is
published.  Decoding goes through the wire codec, and only :data:`ACCEPTED` events pass.

Launchers (``trainguard launch``) send here too: their rank's exit status, as a ``ProcessExit``,
and a :class:`~trainguard.schemas.workload.RankRegistration`, which is not published but filed in
the exporter's rank registry (:mod:`trainguard.streams.exporter.ranks`) under the sender's
kernel-verified pid, for the process source to follow.

Why not ``SO_PEERCRED``: it gives the credentials of the peer of a *connected stream* socket,
taken at ``connect()``; an unconnected datagram socket has no peer.  The datagram equivalent is
``SO_PASSCRED`` on the receiver plus ``recvmsg`` ancillary ``SCM_CREDENTIALS``: the kernel
attaches the sender's pid, uid and gid to every datagram, and a sender without CAP_SETUID /
CAP_SYS_ADMIN can only state its own (so root senders can claim anything: root is trusted).
The pid is as seen from the exporter's pid namespace (0 if the sender is not visible in it),
the uid as mapped into its user namespace.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import grp
import logging
import os
import select
import socket
import struct
import threading
from pathlib import Path
from typing import Any

from trainguard.schemas.base import Event
from trainguard.schemas.codec import DecodeError, decode
from trainguard.schemas.workload import LogLine, ProcessExit, RankRegistration, TrainingStep
from trainguard.streams.exporter.sources.base import KERNEL_SOURCES, SourceContext, register

log = logging.getLogger(__name__)

#: what a training process (or its launcher) may send; anything else is refused.
ACCEPTED = (TrainingStep, ProcessExit, LogLine, RankRegistration)
RCVBUF = 8 * 1024 * 1024
#: largest datagram read (the reporter sends at most ~70 KiB).
MAX_DATAGRAM = 1 << 20
#: ``struct ucred`` of an ``SCM_CREDENTIALS`` message: pid_t pid, uid_t uid, gid_t gid.
_UCRED = struct.Struct("iII")
_ANCBUF = socket.CMSG_SPACE(_UCRED.size)
#: why a datagram or event is refused: not a valid accepted event; sent by a uid not allowed;
#: claims a job other than its sender's; no credentials attached (should not happen on Linux); a
#: rank registration that cannot be followed (its sender outside the exporter's pid namespace,
#: or the registry full).
REASONS = ("invalid", "uid", "job", "no_credentials", "registration")


@dataclasses.dataclass(frozen=True)
class Peer:
    """The kernel-verified sender of one datagram."""

    pid: int
    uid: int
    gid: int


class Rejected(ValueError):
    """A datagram or event refused for ``reason`` (one of :data:`REASONS`)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def group_id(group: str) -> int:
    """The gid of ``group``, a name or a decimal gid."""
    if group.isdecimal():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"reporter socket_group {group!r}: no such group") from None


def bind_socket(path: Path, mode: int = 0o660, group: str = "") -> socket.socket:
    """A non-blocking datagram socket at ``path`` that receives its senders' credentials, with
    file mode ``mode`` and group ``group`` ("" = ours); a stale socket file is replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        with contextlib.suppress(OSError):  # capped by net.core.rmem_max; best effort
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        # Before bind: no datagram may arrive without credentials.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.bind(str(path))
        if group:
            os.chown(path, -1, group_id(group))
        os.chmod(path, mode)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def peer_of(ancdata: list[tuple[int, int, bytes]]) -> Peer | None:
    """The ``SCM_CREDENTIALS`` of one ``recvmsg`` (None if absent or cut short)."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            return Peer(*_UCRED.unpack_from(data))
    return None


def accept(raw: bytes, node: str, job: str) -> Event:
    """Decode one event; set ``node`` to this exporter's; bind it to ``job`` (its sender's job,
    "" = unbound: the event's own stands).  Raise :class:`Rejected` for anything not accepted."""
    try:
        event = decode(raw, local=True)
    except DecodeError as exc:
        raise Rejected("invalid", str(exc)) from None
    if not isinstance(event, ACCEPTED):
        raise Rejected("invalid", f"{event.TYPE!r} is not accepted from a training reporter")
    if isinstance(event, LogLine) and event.source in KERNEL_SOURCES:
        # The node's own sources' names: a line with one is spooled last and read as the
        # kernel's (trainguard.streams.exporter.delivery.SpoolPriority), which a rank is not.
        raise Rejected("invalid", f"a log line from a training process claims source {event.source!r}")
    changes: dict[str, Any] = {}
    if node and event.node != node:
        # The sender runs on this node, whatever it says: a pod's hostname is not the node's
        # name, and a rank naming another machine must not speak for it (#38).
        changes["node"] = node
    if job and event.job != job:
        if event.job:
            raise Rejected("job", f"{event.TYPE} claims job {event.job!r}; its sender's job is {job!r}")
        changes["job"] = job
    return dataclasses.replace(event, **changes) if changes else event


def _loud(n: int) -> bool:
    """Log the n-th refusal of a kind? The first ten, then at powers of two (a flood of
    refusals must not flood the log nor slow the receiver)."""
    return n <= 10 or n & (n - 1) == 0


class ReporterSource:
    name = "reporter"

    def __init__(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg.reporter
        self.path = Path(self.cfg.socket)
        self.sock: socket.socket | None = None
        self.jobs_by_uid = self.cfg.jobs_by_uid
        self.allowed_uids = set(self.cfg.allowed_uids) or {0, os.getuid(), os.geteuid()}
        self.allowed_uids |= set(self.jobs_by_uid)
        #: datagrams and events refused, in all and per reason (:data:`REASONS`).
        self.rejected = 0
        self.rejected_by: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._count_lock = threading.Lock()  # both threads refuse
        #: events received but over the in-memory bound before a round took them.
        self.overflow = 0
        self._overflow_logged = 0
        self._queue: collections.deque[tuple[bytes, Peer]] = collections.deque()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def job_of(self, peer: Peer) -> str:
        """The job ``peer``'s events belong to ("" = whatever they say)."""
        return self.jobs_by_uid.get(peer.uid) or self.ctx.job

    def _reject(self, reason: str, detail: str, peer: Peer | None) -> None:
        with self._count_lock:
            self.rejected += 1
            self.rejected_by[reason] += 1
            n = self.rejected_by[reason]
        self.ctx.dropped(f"reporter_{reason}", 1)
        if _loud(n):
            who = f"pid {peer.pid} uid {peer.uid}" if peer is not None else "unknown sender"
            log.warning("reporter: refused from %s (%s: %d so far): %s", who, reason, n, detail)

    def _start(self) -> None:
        self.sock = bind_socket(self.path, self.cfg.socket_mode, self.cfg.socket_group)
        self._thread = threading.Thread(target=self._receive, name="reporter-recv", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        # The kernel queues few datagrams per socket (net.unix.max_dgram_qlen, 10 on many hosts):
        # drain continuously here, not once per round, or ranks would see EAGAIN and drop steps.
        assert self.sock is not None
        # poll, not select: select() refuses a descriptor numbered 1024 or more, which a busy
        # exporter (or a test process) can hold.
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        while not self._closed.is_set():
            try:
                if not poller.poll(200):
                    continue
                raw, ancdata, _flags, _addr = self.sock.recvmsg(MAX_DATAGRAM, _ANCBUF)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return  # closed under us
            peer = peer_of(ancdata)
            if peer is None:
                self._reject("no_credentials", "datagram without SCM_CREDENTIALS", None)
                continue
            if peer.uid not in self.allowed_uids:  # refused here: it takes no room in the queue
                self._reject("uid", f"uid {peer.uid} may not send ({len(raw)} bytes)", peer)
                continue
            for part in raw.split(b"\n"):
                if not part:
                    continue
                if len(self._queue) >= self.cfg.max_per_round:
                    self.overflow += 1
                    self.ctx.dropped("reporter_queue_full", 1)
                else:
                    self._queue.append((part, peer))

    def collect(self) -> list[Event]:
        if self.sock is None:
            self._start()
        out: list[Event] = []
        while self._queue:
            raw, peer = self._queue.popleft()
            try:
                event = accept(raw, self.ctx.node, self.job_of(peer))
            except Rejected as exc:
                self._reject(exc.reason, str(exc), peer)
                continue
            if isinstance(event, RankRegistration):
                self._register(event, peer)
            else:
                out.append(event)
        if self.overflow > self._overflow_logged:
            self._overflow_logged = self.overflow
            log.warning("reporter: %d events over the in-memory bound were dropped", self.overflow)
        return out

    def _register(self, reg: RankRegistration, peer: Peer) -> None:
        if self.ctx.ranks.add(reg, peer.pid):
            return
        why = (
            "its launcher is not visible in the exporter's pid namespace"
            if peer.pid <= 0
            else f"{self.ctx.ranks.max_ranks} launchers are registered already"
        )
        self._reject("registration", f"rank {reg.rank} of job {reg.job} not followed: {why}", peer)

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
