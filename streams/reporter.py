"""The training reporter: step telemetry and exit reasons from inside a training process.

>>> from trainguard.streams.reporter import Reporter
>>> rep = Reporter(job="demo", rank=0, socket_path="/nonexistent/reporter.sock", capture_exceptions=False,
...                flight_recorder=False)
>>> rep.step(1, loss=2.5, grad_norm=1.1, tokens=4096)
>>> rep.close(exit_code=0)

Delivery goes **through the node's exporter**, as Unix datagrams of newline-separated events
(``$TRAINGUARD_REPORTER_SOCKET``, default ``/run/trainguard/reporter.sock``), not straight to
Kafka: a node then holds one Kafka connection instead of one per rank (8x fewer at scale), the
exporter's on-disk spool covers broker outages for step telemetry too, training containers need
no Kafka credentials, and this module imports nothing heavier than the stdlib and ``schemas``.
If the exporter is down, the datagrams are counted as dropped (its missing heartbeat is the alarm).

**Data wait.**  A training loop that passes ``data_wait_s`` to ``step()`` lets the slow-data
detector see a loader that starves compute.  Measure it around the fetch, nothing else::

    batches = iter(loader)
    while True:
        t0 = time.perf_counter()
        batch = next(batches)  # blocks while the loader's workers have no batch ready
        data_wait_s = time.perf_counter() - t0
        ...  # forward, backward, optimizer step
        rep.step(step, loss=loss, data_wait_s=data_wait_s)

(With ``trainguard.streams.data_position.DataPosition.batches``, time the ``next()`` on its iterator the same
way.)  A host-to-device copy belongs to the step, not to the wait.

``step()`` never blocks and never raises: it timestamps the call and appends a tuple to a bounded
in-memory queue (drop-and-count when full); a daemon thread builds the events, encodes them and
sends them.  Each published step carries ``dropped``, the steps lost since the previous one.
Uncaught exceptions (main thread: a ``ProcessExit`` with the traceback; other threads: a
``LogLine``), SIGTERM and the interpreter's exit are reported too.

**Flight Recorder.**  Unless turned off (``flight_recorder=False`` or
``TRAINGUARD_FLIGHT_RECORDER=0``), the reporter turns on PyTorch's Flight Recorder
(``TORCH_FR_BUFFER_SIZE``, 200 entries, unless already set) and has PyTorch dump it on a
collective timeout into ``<fr_dir>/timeout/rank_<R>``; both are read when the first process group
is made, so **create the Reporter before** ``init_process_group``.  It also answers the node
exporter's captures: the rank registers in ``<fr_dir>/ranks/<R>.json``, and a thread
(``trainguard-fr``) polls ``<fr_dir>/requests/`` every 0.25 s; for each new request it writes the
rank's dump (PyTorch's JSON of both its recorders, NCCL's and the generic one, merged) to
``<fr_dir>/dumps/<capture_id>/rank_<R>``, or why it
could not to ``rank_<R>.error``.  The dump runs on that thread, so it answers while the main thread
is blocked in a collective or busy in Python, and ``step()`` never waits for it.  ``fr_dir`` is
``$TRAINGUARD_FR_DIR``, else ``fr`` beside the exporter socket (where the exporter looks by
default).  Torch is never imported here: the dump is taken only when the training code has
imported ``torch.distributed`` and initialised it.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from types import FrameType, TracebackType
from typing import Any

from trainguard.schemas.base import Event
from trainguard.schemas.codec import encode
from trainguard.schemas.enums import ProcessRole
from trainguard.schemas.workload import LogLine, ProcessExit, TrainingStep

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/trainguard/reporter.sock"
#: Unix datagrams above ~200 KiB need a larger send buffer; tracebacks are cut to this.
MAX_TRACEBACK = 64 * 1024
#: steps packed into one datagram, at most this many bytes.
MAX_DATAGRAM = 60 * 1024
#: how often the Flight Recorder thread looks for capture requests.
FR_POLL_S = 0.25
#: Flight Recorder entries PyTorch keeps per process (its ring buffer) unless the job set it:
#: the last few hundred collectives say where each group stands, and a dump costs in proportion
#: (PyTorch's own default, 2,000, made each rank's dump 0.9 MB of JSON, taken and parsed on every
#: hang capture: in the demo's bursts of captures that slowed the job itself).
FR_BUFFER_SIZE = "200"
#: a capture id is a file name: no separators, no leading dot (temporary files start with one).
FR_CAPTURE_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
#: requests whose mtime is this much before the reporter started are a previous process's: the
#: file system's clock is coarse (a few ms behind ``time.time()``), so a slack avoids skipping a
#: request written right after start.
FR_START_SLACK_S = 1.0
#: how often the registration's modification time is refreshed (the exporter's liveness check
#: across pid namespaces: ``flight_recorder.registration_fresh_s``).
FR_REFRESH_S = 5.0
#: capture ids remembered as answered (only requests still present are kept, so this is a cap).
FR_MAX_HANDLED = 1024


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _fr_enabled(flag: bool | None) -> bool:
    """The ``flight_recorder`` argument, else on unless ``TRAINGUARD_FLIGHT_RECORDER=0``."""
    if flag is not None:
        return flag
    return os.environ.get("TRAINGUARD_FLIGHT_RECORDER", "1") != "0"


def _unset(*names: str) -> bool:
    return not any(n in os.environ for n in names)


def enable_torch_flight_recorder(fr_dir: str) -> None:
    """Turn on PyTorch's Flight Recorder and its dump on a collective timeout (into
    ``<fr_dir>/timeout/rank_<R>``), unless the job configured them.  PyTorch reads these when a
    process group is made, so this must run before ``init_process_group``.

    A variable the job set under its older name counts as set: PyTorch prefers the current name,
    so setting that one too would override the job.  The buffer size is set under the current
    name only (PyTorch warns that the older one is deprecated); the dump file under both, for
    PyTorch versions that know only the older one (they read it only to write a dump)."""
    if _unset("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        os.environ["TORCH_FR_BUFFER_SIZE"] = FR_BUFFER_SIZE
    if _unset("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        prefix = os.path.join(fr_dir, "timeout", "rank_")
        os.environ["TORCH_FR_DUMP_TEMP_FILE"] = os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = prefix
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


def write_atomic(path: str, data: bytes) -> None:
    """Write ``path`` so that a reader sees all of it or nothing: a hidden temporary file in the
    same directory (readers skip dot files), then a rename."""
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".{name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class NoFlightRecorderDump(Exception):
    """Why this process has no Flight Recorder dump to give (one line)."""


#: PyTorch's JSON dump functions: NCCL's recorder (NCCL groups record there only: the generic
#: recorder's dump of a 1-rank NCCL job on an H100 held no entry, torch 2.11) and the generic one
#: (gloo and the other backends).  The older name of each is tried when the newer is missing.
_DUMPERS = (("_dump_nccl_trace_json",), ("_dump_fr_trace_json",))


def torch_flight_recorder_dump() -> bytes:
    """This process's Flight Recorder dump (PyTorch's JSON: both of its recorders merged, see
    :func:`merge_dumps`), or :class:`NoFlightRecorderDump`.

    Torch is looked up, never imported: a process that has not imported and initialised
    ``torch.distributed`` has no recorder to dump, and importing torch here would cost seconds
    and memory in a process that may not use it."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        raise NoFlightRecorderDump("torch.distributed is not imported in this process")
    if not (dist.is_available() and dist.is_initialized()):
        raise NoFlightRecorderDump("torch.distributed is not initialized in this process")
    c10d = sys.modules.get("torch._C._distributed_c10d") or getattr(
        getattr(sys.modules.get("torch"), "_C", None), "_distributed_c10d", None
    )
    docs, errors = [], []
    for names in _DUMPERS:
        fn = next((getattr(c10d, n) for n in names if getattr(c10d, n, None) is not None), None)
        if fn is None:
            continue
        try:
            data = fn()
            doc = json.loads(data.decode() if isinstance(data, bytes | bytearray) else data)
        except Exception as exc:  # a build without NCCL, or no such recorder in this process
            errors.append(f"{names[0]}: {type(exc).__name__}: {exc}")
            continue
        if isinstance(doc, dict):
            docs.append(doc)
    if not docs:
        why = "; ".join(errors) or "this PyTorch has no Flight Recorder (no _dump_fr_trace_json)"
        raise NoFlightRecorderDump(why)
    return json.dumps(merge_dumps(docs), separators=(",", ":")).encode()


def merge_dumps(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One dump from PyTorch's two recorders' (NCCL's and the generic one): every process group
    and every entry, the entries in the order they were created.  A recorder with no entry adds
    nothing (its version and groups would only repeat the other's)."""
    useful = [d for d in docs if d.get("entries")] or docs[:1]
    if len(useful) == 1:
        return useful[0]
    out = dict(useful[0])
    for key in ("pg_config", "pg_status"):
        merged: dict[str, Any] = {}
        for d in useful:
            if isinstance(d.get(key), dict):
                merged.update(d[key])
        out[key] = merged
    entries = [e for d in useful for e in d.get("entries") or [] if isinstance(e, dict)]
    out["entries"] = sorted(entries, key=lambda e: e.get("time_created_ns") or 0)
    return out


class FlightRecorderAgent:
    """The rank's side of the node exporter's Flight Recorder captures: registration, and a
    thread answering requests with dumps (see the module docstring)."""

    def __init__(self, fr_dir: str, rank: int, job: str) -> None:
        self.dir, self.rank, self.job = fr_dir, rank, job
        self.started = time.time()
        self.registration = os.path.join(fr_dir, "ranks", f"{rank}.json")
        #: capture ids answered (or skipped), insertion-ordered; only ones still requested are kept.
        self.handled: dict[str, None] = {}
        self.answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainguard-fr", daemon=True)

    def start(self) -> bool:
        """Enable PyTorch's recorder, register and start answering; False (logged) if the
        directory is not usable -- training goes on without it."""
        enable_torch_flight_recorder(self.dir)
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            log.warning(
                "reporter: created after init_process_group: PyTorch's Flight Recorder is on only "
                "if TORCH_FR_BUFFER_SIZE was set before it"
            )
        try:
            os.makedirs(os.path.join(self.dir, "timeout"), exist_ok=True)
            os.makedirs(os.path.dirname(self.registration), exist_ok=True)
            info = {"rank": self.rank, "pid": os.getpid(), "job": self.job}
            write_atomic(self.registration, json.dumps(info).encode())
        except OSError as exc:
            log.warning("reporter: Flight Recorder captures off: %s: %s", self.dir, exc)
            return False
        self._thread.start()
        atexit.register(self.stop)
        return True

    def stop(self) -> None:
        """Stop answering and withdraw the registration (idempotent)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(1.0)  # a dump in progress may take a moment; never wait long
        self.unregister()
        atexit.unregister(self.stop)

    def unregister(self) -> None:
        """Remove the registration if it is still this process's (a restarted rank may own it)."""
        try:
            with open(self.registration, "rb") as fh:
                mine = json.loads(fh.read()).get("pid") == os.getpid()
            if mine:
                os.unlink(self.registration)
        except (OSError, ValueError, AttributeError):
            pass

    def _run(self) -> None:
        refreshed = time.monotonic()
        while not self._stop.wait(FR_POLL_S):
            try:
                self.poll()
                if time.monotonic() - refreshed >= FR_REFRESH_S:
                    # A fresh registration says "alive" where the exporter cannot check the pid
                    # (it runs in another pid namespace: a training pod without hostPID).
                    refreshed = time.monotonic()
                    os.utime(self.registration)
            except Exception as exc:  # never into training: the next poll tries again
                log.warning("reporter: Flight Recorder poll failed: %s", exc)

    def poll(self) -> int:
        """Answer the requests not yet answered; returns how many were answered."""
        try:
            names = os.listdir(os.path.join(self.dir, "requests"))
        except OSError:  # no capture yet (the exporter makes the directory)
            return 0
        present = {n for n in names if FR_CAPTURE_ID.fullmatch(n)}
        self.handled = {cid: None for cid in self.handled if cid in present}
        answered = 0
        for cid in sorted(present - self.handled.keys()):
            if self._stop.is_set():
                break
            self.handled[cid] = None
            try:
                mtime = os.stat(os.path.join(self.dir, "requests", cid)).st_mtime
            except OSError:  # withdrawn meanwhile
                continue
            if mtime >= self.started - FR_START_SLACK_S:  # older ones: a previous process's
                self.answer(cid)
                answered += 1
        while len(self.handled) > FR_MAX_HANDLED:
            del self.handled[next(iter(self.handled))]
        return answered

    def answer(self, capture_id: str) -> None:
        """Write this rank's dump for ``capture_id``, or why there is none."""
        out = os.path.join(self.dir, "dumps", capture_id)
        name = f"rank_{self.rank}"
        t0 = time.perf_counter()
        try:
            data, name_written = torch_flight_recorder_dump(), name
        except NoFlightRecorderDump as exc:
            data, name_written = str(exc).encode(), name + ".error"
        except Exception as exc:
            why = f"Flight Recorder dump failed: {type(exc).__name__}: {exc}"
            data, name_written = " ".join(why.split())[:2000].encode(), name + ".error"
        took = time.perf_counter() - t0
        try:
            os.makedirs(out, exist_ok=True)
            write_atomic(os.path.join(out, name_written), data)
        except OSError as exc:
            log.warning("reporter: capture %s: cannot write %s: %s", capture_id, name_written, exc)
            return
        self.answered += 1
        log.info(
            "reporter: capture %s: %s, %d bytes, dump took %.3f s", capture_id, name_written, len(data), took
        )


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
        flight_recorder: bool | None = None,
        fr_dir: str | None = None,
    ) -> None:
        self.job = job if job is not None else os.environ.get("TRAINGUARD_JOB", "")
        self.rank = rank if rank is not None else _env_int("RANK", 0)
        self.node = node if node is not None else os.environ.get("TRAINGUARD_NODE", "")
        self.socket_path = socket_path or os.environ.get("TRAINGUARD_REPORTER_SOCKET", DEFAULT_SOCKET)
        self.fr_dir = (
            fr_dir
            or os.environ.get("TRAINGUARD_FR_DIR")
            or os.path.join(os.path.dirname(self.socket_path), "fr")
        )
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
        self._log_seq = 0
        self._lock = threading.Lock()  # serialises sending (thread vs. exit paths), never step()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        self._sock.setblocking(False)
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainguard-reporter", daemon=True)
        self._thread.start()
        self._fr: FlightRecorderAgent | None = None
        if _fr_enabled(flight_recorder):
            agent = FlightRecorderAgent(self.fr_dir, self.rank, self.job)
            self._fr = agent if agent.start() else None
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
        data_wait_s: float | None = None,
    ) -> None:
        """Record one optimizer step; O(1), no I/O, no locks, no allocation beyond one tuple.

        ``data_wait_s``: how long this step waited for its batch -- the time around the loop's
        ``next()`` on the data iterator (see the module docstring); the slow-data detector
        compares it with the step time."""
        now = time.perf_counter()
        if step_time_s is None and self._last_t is not None:
            step_time_s = now - self._last_t
        self._last_t = now
        if len(self._queue) >= self.queue_size:
            self._full_drops += 1
            return
        item = (step, time.time_ns() // 1_000_000, loss, grad_norm, tokens, step_time_s, data_wait_s)
        self._queue.append(item)

    def log(self, line: str, source: str = "trainguard") -> bool:
        """Send one log line of the training process now (``LogLine``, this rank's job and node):
        for what the rule table should see at once and the process may not print -- the shadow
        loader's takeovers (``trainguard.streams.shadow_loader.LoaderEvent.line``).  Never raises; False when
        the exporter did not take it (its socket absent or full)."""
        with self._lock:
            self._log_seq += 1
            event = LogLine(node=self.node, ts_ms=time.time_ns() // 1_000_000, source=source, job=self.job,
                            rank=self.rank, line=line[-65_536:], seq=self._log_seq)  # fmt: skip
            return self._send(event)

    @property
    def dropped(self) -> int:
        """Steps lost so far: queue full, or the exporter socket absent/full."""
        return self._full_drops + self._send_drops

    # -- background ----------------------------------------------------------------------------
    def _event(self, item: tuple[Any, ...]) -> TrainingStep:
        step, ts_ms, loss, grad_norm, tokens, step_time, data_wait = item
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
            data_wait_s=None if data_wait is None else float(data_wait),
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
        if self._fr is not None:
            self._fr.stop()
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
        self.log(f"uncaught exception in thread {name}: {text}", source="stderr")
        self._prev_thread_hook(args)

    def _atexit(self) -> None:
        # The interpreter is exiting without close(): the exit code is not visible from here.
        if not self._exit_sent:
            self.report_exit(reason="interpreter exit without Reporter.close()")

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.report_exit(reason="SIGTERM", signal_no=signum)
        if self._fr is not None:
            self._fr.unregister()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # die as SIGTERM would have killed us
