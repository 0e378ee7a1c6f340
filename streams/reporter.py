"""The training reporter: step telemetry and exit reasons from inside a training process.

>>> from streams.reporter import Reporter
>>> rep = Reporter(job="demo", rank=0, socket_path="/nonexistent/reporter.sock", capture_exceptions=False)
>>> rep.step(1, loss=2.5, grad_norm=1.1, tokens=4096)
>>> rep.close(exit_code=0)

Delivery goes **through the node's exporter**, as Unix datagrams of newline-separated events
(``$TRAINGUARD_REPORTER_SOCKET``, default ``/run/trainguard/reporter.sock``), not straight to
Kafka: a node then holds one Kafka connection instead of one per rank (8x fewer at scale), the
exporter's on-disk spool covers broker outages for step telemetry too, training containers need
no Kafka credentials, and this module imports nothing heavier than the stdlib and ``schemas``.
If the exporter is down, the datagrams are counted as dropped (its missing heartbeat is the alarm).

``step()`` never blocks and never raises: it timestamps the call and appends a tuple to a bounded
in-memory queue (drop-and-count when full); a daemon thread builds the events, encodes them and
sends them.  Each published step carries ``dropped``, the steps lost since the previous one.
Uncaught exceptions (main thread: a ``ProcessExit`` with the traceback; other threads: a
``LogLine``), SIGTERM and the interpreter's exit are reported too.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from types import FrameType, TracebackType
from typing import Any

from schemas.base import Event
from schemas.codec import encode
from schemas.enums import ProcessRole
from schemas.workload import LogLine, ProcessExit, TrainingStep

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/trainguard/reporter.sock"
#: Unix datagrams above ~200 KiB need a larger send buffer; tracebacks are cut to this.
MAX_TRACEBACK = 64 * 1024
#: steps packed into one datagram, at most this many bytes.
MAX_DATAGRAM = 60 * 1024


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


class Reporter:
    """Publishes a rank's step telemetry and exit reason; see the module docstring.

    ``flops_per_step`` (this rank's model FLOPs per step) and ``peak_flops`` (this rank's device
    peak FLOP/s) give MFU = flops_per_step / step_time / peak_flops.
    """

    def __init__(
        self,
        job: str | None = None,
        rank: int | None = None,
        node: str | None = None,
        *,
        socket_path: str | None = None,
        flops_per_step: float | None = None,
        peak_flops: float | None = None,
        queue_size: int = 4096,
        flush_interval_s: float = 0.05,
        capture_exceptions: bool = True,
        capture_sigterm: bool = True,
    ) -> None:
        self.job = job if job is not None else os.environ.get("TRAINGUARD_JOB", "")
        self.rank = rank if rank is not None else _env_int("RANK", 0)
        self.node = node if node is not None else os.environ.get("TRAINGUARD_NODE", "")
        self.socket_path = socket_path or os.environ.get("TRAINGUARD_REPORTER_SOCKET", DEFAULT_SOCKET)
        self.flops_per_step = flops_per_step
        self.peak_flops = peak_flops
        self.queue_size = queue_size
        self.flush_interval_s = flush_interval_s
        self._queue: collections.deque[tuple[Any, ...]] = collections.deque()
        self._last_t: float | None = None
        # Two counters, each written by one thread only (no lock on the hot path).
        self._full_drops = 0
        self._send_drops = 0
        self._dropped_reported = 0
        self.sent = 0
        self._exit_sent = False
        self._closed = False
        self._lock = threading.Lock()  # serialises sending (thread vs. exit paths), never step()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        self._sock.setblocking(False)
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainguard-reporter", daemon=True)
        self._thread.start()
        self._prev_excepthook: Any = None
        self._sigterm_installed = False
        if capture_exceptions:
            self._prev_excepthook = sys.excepthook
            sys.excepthook = self._excepthook
            self._prev_thread_hook = threading.excepthook
            threading.excepthook = self._thread_excepthook
            atexit.register(self._atexit)
        if (
            capture_sigterm
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        ):
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self._sigterm_installed = True

    # -- hot path ------------------------------------------------------------------------------
    def step(
        self,
        step: int,
        *,
        loss: float | None = None,
        grad_norm: float | None = None,
        tokens: int | None = None,
        step_time_s: float | None = None,
    ) -> None:
        """Record one optimizer step; O(1), no I/O, no locks, no allocation beyond one tuple."""
        now = time.perf_counter()
        if step_time_s is None and self._last_t is not None:
            step_time_s = now - self._last_t
        self._last_t = now
        if len(self._queue) >= self.queue_size:
            self._full_drops += 1
            return
        self._queue.append((step, time.time_ns() // 1_000_000, loss, grad_norm, tokens, step_time_s))

    @property
    def dropped(self) -> int:
        """Steps lost so far: queue full, or the exporter socket absent/full."""
        return self._full_drops + self._send_drops

    # -- background ----------------------------------------------------------------------------
    def _event(self, item: tuple[Any, ...]) -> TrainingStep:
        step, ts_ms, loss, grad_norm, tokens, step_time = item
        tps = mfu = None
        if step_time and step_time > 0:
            if tokens is not None:
                tps = tokens / step_time
            if self.flops_per_step and self.peak_flops:
                mfu = self.flops_per_step / step_time / self.peak_flops
                if not 0 <= mfu <= 1:  # misconfigured FLOPs: say nothing rather than lie
                    mfu = None
        total = self.dropped
        dropped, self._dropped_reported = total - self._dropped_reported, total
        return TrainingStep(
            job=self.job,
            rank=self.rank,
            step=int(step),
            ts_ms=ts_ms,
            node=self.node,
            loss=None if loss is None else float(loss),
            grad_norm=None if grad_norm is None else float(grad_norm),
            step_time_s=step_time,
            tokens=tokens,
            tokens_per_s=tps,
            mfu=mfu,
            dropped=dropped,
        )

    def _send(self, event: Event) -> bool:
        """One event in its own datagram (exits and thread errors: rare, and must go now)."""
        try:
            self._sock.sendto(encode(event), self.socket_path)
        except OSError:
            return False
        self.sent += 1
        return True

    def flush(self) -> None:
        """Send everything queued now (the background thread does this every flush interval).

        Events are packed newline-separated into datagrams of up to :data:`MAX_DATAGRAM` bytes,
        so a fast loop costs few syscalls and few slots in the exporter's socket queue."""
        with self._lock:
            batch: list[bytes] = []
            size = 0
            while self._queue:
                item = self._queue.popleft()
                try:
                    raw = encode(self._event(item))
                except (ValueError, TypeError) as exc:  # e.g. a negative grad norm: schema says no
                    log.warning("reporter: step %r not sent: %s", item[0], exc)
                    self._send_drops += 1
                    continue
                if batch and size + len(raw) + 1 > MAX_DATAGRAM:
                    self._send_batch(batch)
                    batch, size = [], 0
                batch.append(raw)
                size += len(raw) + 1
            if batch:
                self._send_batch(batch)

    def _send_batch(self, batch: list[bytes]) -> None:
        try:
            self._sock.sendto(b"\n".join(batch), self.socket_path)
        except OSError:  # no exporter, or its queue is full: never wait for it
            self._send_drops += len(batch)
            return
        self.sent += len(batch)

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.flush_interval_s)
            self.flush()

    # -- exits ---------------------------------------------------------------------------------
    def report_exit(
        self, exit_code: int | None = None, reason: str = "", signal_no: int | None = None, tb: str = ""
    ) -> None:
        """Publish this process's exit once (later calls are ignored)."""
        self.flush()
        with self._lock:
            if self._exit_sent:
                return
            self._exit_sent = True
            self._send(
                ProcessExit(
                    node=self.node,
                    ts_ms=time.time_ns() // 1_000_000,
                    pid=os.getpid(),
                    job=self.job,
                    rank=self.rank,
                    role=ProcessRole.MAIN,
                    exit_code=exit_code,
                    signal=signal_no,
                    reason=(reason or "exit")[:4096],
                    traceback=tb[-MAX_TRACEBACK:],
                )
            )

    def close(self, exit_code: int | None = None, reason: str = "") -> None:
        """Flush, report the exit (``reason`` defaults to "finished") and stop the thread."""
        self.report_exit(exit_code=exit_code, reason=reason or "finished")
        self._closed = True
        self._wake.set()
        self._thread.join(1.0)
        if self._prev_excepthook is not None:
            sys.excepthook = self._prev_excepthook
            threading.excepthook = self._prev_thread_hook
            atexit.unregister(self._atexit)
            self._prev_excepthook = None
        if self._sigterm_installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._sigterm_installed = False
        self._sock.close()

    def _excepthook(self, etype: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        text = "".join(traceback.format_exception(etype, value, tb))
        self.report_exit(exit_code=1, reason=f"uncaught {etype.__name__}: {value}", tb=text)
        self._prev_excepthook(etype, value, tb)

    def _thread_excepthook(self, args: threading.ExceptHookArgs) -> None:
        text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
        name = args.thread.name if args.thread is not None else "?"
        self._send(
            LogLine(
                node=self.node,
                ts_ms=time.time_ns() // 1_000_000,
                source="stderr",
                job=self.job,
                rank=self.rank,
                line=f"uncaught exception in thread {name}: {text}"[-65_536:],
            )
        )
        self._prev_thread_hook(args)

    def _atexit(self) -> None:
        # The interpreter is exiting without close(): the exit code is not visible from here.
        if not self._exit_sent:
            self.report_exit(reason="interpreter exit without Reporter.close()")

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.report_exit(reason="SIGTERM", signal_no=signum)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # die as SIGTERM would have killed us
