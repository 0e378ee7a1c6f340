"""PyTorch Flight Recorder dumps of this node's training ranks, as
:class:`~trainguard.schemas.workload.FlightRecorderDump` events.

The exporter cannot dump another process's Flight Recorder (it lives in the rank's memory, and
only PyTorch in that process can serialise it), so dumps travel through a directory shared with
the ranks' reporters (:mod:`trainguard.streams.reporter`), ``flight_recorder.dir``, by default ``fr`` beside
the reporter socket::

    ranks/<R>.json               a reporter's registration: {"rank", "pid", "job"}
    requests/<capture_id>        written here: "dump now"
    dumps/<capture_id>/rank_<R>  a rank's answer (PyTorch's JSON) ...
    dumps/<capture_id>/rank_<R>.error   ... or why it has none (one line)
    timeout/rank_<R>             PyTorch's own dump when a collective timed out

A **capture** (a ``capture_stacks`` command asking for it) writes a request, waits up to
``wait_s`` for every registered live rank's answer and publishes one event per local rank: the
parsed dump (parsed here, with the restricted unpickler or JSON, never shipped raw), or an event
whose ``error`` says why there is none -- no answer in time, an unreadable dump, or a training
process that never registered (its reporter is off or absent).  A worker joining a capture thus
gets exactly one answer per local rank.  **Timeout dumps** are picked up by a background thread
once PyTorch has finished writing them, published (trigger ``timeout``) and deleted; an unreadable
one is moved to ``timeout/bad/``.  Errors never stop the exporter: they are logged and counted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainguard.detectors.flight_recorder import FlightRecorderError, dump_to_event, parse_dump
from trainguard.infra.proctable import DEAD_STATES, LIVE, STOPPED_STATES
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.enums import ProcessRole
from trainguard.schemas.telemetry import SourceHealth
from trainguard.schemas.workload import FlightRecorderDump
from trainguard.streams.exporter.config import FlightRecorderConfig
from trainguard.streams.exporter.sources.process import TrackedProcess

log = logging.getLogger(__name__)

#: a capture id names files: letters, digits, ``_.-``, no leading dot (hidden files are temporary).
CAPTURE_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,199}")
#: PyTorch names its timeout dumps ``<prefix><rank>``; the reporter sets the prefix to ``rank_``.
TIMEOUT_DUMP = re.compile(r"rank_(\d{1,7})")
#: requests and dump directories older than this are a crashed exporter's leftovers.
STALE_S = 600.0
#: how often a capture looks for the ranks' answers.
ANSWER_POLL_S = 0.05
NOT_ENABLED = "Flight Recorder not enabled in this rank (no reporter registration)"


@dataclass(frozen=True)
class Registration:
    """A rank's reporter, as its ``ranks/<R>.json`` says."""

    rank: int
    pid: int
    job: str


def read_regular(path: Path, max_bytes: int) -> tuple[bytes, int]:
    """(content, mtime in ms) of a regular file no larger than ``max_bytes``.

    The directory is writable by the training processes, so nothing in it is trusted: a symlink
    is not followed, and a FIFO or device is not read (it could block or never end).  ValueError
    names what is wrong; OSError when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path.name} is not a regular file")
        if st.st_size > max_bytes:
            raise ValueError(f"dump is {st.st_size} bytes, over the {max_bytes}-byte limit")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew after the fstat
        raise ValueError(f"dump is over the {max_bytes}-byte limit")
    return data, st.st_mtime_ns // 1_000_000


def read_registrations(
    ranks_dir: Path, alive: Callable[[int], bool], fresh_s: float = 0.0
) -> dict[int, Registration]:
    """The registrations of live processes, by rank (a dead pid's file is a killed rank's).  A
    rank whose pid is not alive here but whose file was refreshed within ``fresh_s`` counts as
    live too: its pid is in another pid namespace (a training pod without ``hostPID``)."""
    now = time.time()
    out: dict[int, Registration] = {}
    try:
        paths = sorted(p for p in ranks_dir.iterdir() if p.suffix == ".json" and not p.name.startswith("."))
    except OSError:
        return out
    for p in paths:
        try:
            raw, mtime_ms = read_regular(p, 4096)
            doc = json.loads(raw)
            reg = Registration(int(doc["rank"]), int(doc["pid"]), str(doc.get("job") or ""))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            log.warning("flight recorder: ignoring registration %s: %s", p, exc)
            continue
        fresh = fresh_s > 0 and now - mtime_ms / 1000 <= fresh_s
        if reg.rank >= 0 and reg.pid > 0 and (alive(reg.pid) or fresh):
            out[reg.rank] = reg
    return out


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _age_s(path: Path, now: float) -> float:
    try:
        return now - path.lstat().st_mtime
    except OSError:
        return 0.0


class FlightRecorderCollector:
    """Runs Flight Recorder captures on request and collects PyTorch's timeout dumps.

    ``cfg.dir`` must be set (the service resolves the default, see
    :attr:`~trainguard.streams.exporter.config.ExporterConfig.flight_recorder_dir`).  ``discover`` and
    ``publish`` are :class:`~trainguard.streams.exporter.stack_capture.StackCapturer`'s; ``alive`` tells a
    registered pid still runs (the service's process table)."""

    def __init__(
        self,
        cfg: FlightRecorderConfig,
        node: str,
        job: str,
        discover: Callable[[], list[TrackedProcess]],
        publish: Callable[[Event], None],
        alive: Callable[[int], bool] = LIVE.alive,
    ) -> None:
        if not cfg.dir:
            raise ValueError("flight_recorder.dir is not set")
        self.cfg, self.node, self.job = cfg, node, job
        self.discover, self.publish, self.alive = discover, publish, alive
        self.dir = Path(cfg.dir)
        self.errors = 0
        self.published = 0
        self.captures = 0
        self.last_error = ""
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._poller: threading.Thread | None = None
        #: timeout dump name -> (size, mtime_ns, monotonic time that signature was first seen).
        self._settling: dict[str, tuple[int, int, float]] = {}

    # -- bookkeeping ---------------------------------------------------------------------------
    def _fail(self, text: str) -> None:
        self.errors += 1
        self.last_error = text[:4096]
        log.warning("flight recorder: %s", text)

    def _emit(self, event: FlightRecorderDump) -> None:
        try:
            self.publish(event)
        except Exception as exc:  # a full spool, an event the schema refuses: count, go on
            self._fail(f"rank {event.rank}: publishing failed: {type(exc).__name__}: {exc}")
            return
        self.published += 1

    def _error_event(
        self, rank: int, capture_id: str, pid: int, error: str, trigger: str = "capture", job: str = ""
    ) -> None:
        """An event saying why ``rank`` has no dump (``job``: its registration's, when this
        exporter serves any job)."""
        self._emit(
            FlightRecorderDump(
                job=self.job or job,
                node=self.node,
                rank=rank,
                ts_ms=now_ms(),
                capture_id=capture_id,
                trigger=trigger,
                pid=pid,
                error=error[:4096],
            )
        )

    def _dump_event(self, path: Path, rank: int, capture_id: str, pid: int, job: str, trigger: str) -> bool:
        """Publish the dump at ``path`` (True), or an error event saying why it is unreadable (False)."""
        try:
            data, mtime_ms = read_regular(path, self.cfg.max_bytes)
            event = dump_to_event(
                parse_dump(data, rank, str(path)),
                job=self.job or job,
                node=self.node,
                ts_ms=mtime_ms,
                capture_id=capture_id,
                trigger=trigger,
                pid=pid,
                max_entries=self.cfg.max_entries,
                per_group=self.cfg.max_entries_per_group,
            )
        except (OSError, ValueError, TypeError) as exc:  # FlightRecorderError is a ValueError
            why = str(exc) if isinstance(exc, FlightRecorderError) else f"{path.name}: {exc}"
            self._fail(f"rank {rank}: unreadable dump: {why}")
            why = f"unreadable Flight Recorder dump: {why}"
            self._error_event(rank, capture_id, pid, why, trigger, job)
            return False
        self._emit(event)
        return True

    # -- captures ------------------------------------------------------------------------------
    def request(self, capture_id: str) -> threading.Thread:
        """Run :meth:`capture` on its own thread (sampling and py-spy go on meanwhile)."""
        t = threading.Thread(
            target=self._guarded, args=(capture_id,), name=f"fr-{capture_id[:8]}", daemon=True
        )
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()
        return t

    def _guarded(self, capture_id: str) -> None:
        try:
            self.capture(capture_id)
        except Exception as exc:
            self._fail(f"capture {capture_id} failed: {type(exc).__name__}: {exc}")
            log.exception("flight recorder capture %s failed", capture_id)

    def _unregistered_ranks(self, registered: dict[int, Registration]) -> dict[int, int]:
        """Live main training processes (rank -> pid) that no reporter registered."""
        try:
            procs = self.discover()
        except Exception as exc:
            self._fail(f"process discovery failed: {exc}")
            return {}
        out: dict[int, int] = {}
        for p in procs:
            live_main = p.role is ProcessRole.MAIN and p.state not in DEAD_STATES
            if live_main and p.rank >= 0 and p.rank not in registered:
                out.setdefault(p.rank, p.pid)
        return out

    def capture(self, capture_id: str) -> int:
        """One capture, blocking (up to ``wait_s``): one event per local rank; returns how many."""
        started = time.monotonic()
        self.sweep_stale()
        registered = read_registrations(self.dir / "ranks", self.alive, self.cfg.registration_fresh_s)
        unregistered = self._unregistered_ranks(registered)
        if not CAPTURE_ID.fullmatch(capture_id):  # never a path outside the directory
            self._fail(f"capture id {capture_id!r} is not usable as a file name")
            for rank, reg in registered.items():
                why = "capture id not usable as a file name"
                self._error_event(rank, capture_id, reg.pid, why, job=reg.job)
            for rank, pid in unregistered.items():
                self._error_event(rank, capture_id, pid, NOT_ENABLED)
            return len(registered) + len(unregistered)
        for rank, pid in sorted(unregistered.items()):
            self._error_event(rank, capture_id, pid, NOT_ENABLED)
        request = self.dir / "requests" / capture_id
        dumps = self.dir / "dumps" / capture_id
        try:
            if registered:
                request.parent.mkdir(parents=True, exist_ok=True)
                body = {"capture_id": capture_id, "ts_ms": now_ms(), "ranks": sorted(registered)}
                _write_atomic(request, json.dumps(body).encode())
                self._collect_answers(capture_id, registered, dumps)
        except OSError as exc:
            self._fail(f"capture {capture_id}: {exc}")
            for rank, reg in registered.items():
                why = f"Flight Recorder request failed: {exc}"
                self._error_event(rank, capture_id, reg.pid, why, job=reg.job)
        finally:
            request.unlink(missing_ok=True)
            shutil.rmtree(dumps, ignore_errors=True)
        self.captures += 1
        log.info(
            "flight recorder capture %s: %d registered, %d unregistered rank(s), %.2f s",
            capture_id,
            len(registered),
            len(unregistered),
            time.monotonic() - started,
        )
        return len(registered) + len(unregistered)

    def _collect_answers(self, capture_id: str, registered: dict[int, Registration], dumps: Path) -> None:
        """Publish each rank's answer as it lands; after ``wait_s``, an error for the silent ones."""
        pending = dict(registered)
        deadline = time.monotonic() + self.cfg.wait_s
        # A stopped rank (SIGSTOP, a debugger) runs none of its own code, so it cannot write its
        # dump: say so now instead of after wait_s -- the capture waits for every rank's answer.
        stopped = self._stopped_pids()
        for rank, reg in sorted(pending.items()):
            if reg.pid in stopped:
                why = "the rank's process is stopped (state T): it cannot write its Flight Recorder"
                self._error_event(rank, capture_id, reg.pid, why, job=reg.job)
                del pending[rank]
        while pending:
            for rank, reg in list(pending.items()):
                dump, error = dumps / f"rank_{rank}", dumps / f"rank_{rank}.error"
                if os.path.lexists(dump):
                    self._dump_event(dump, rank, capture_id, reg.pid, reg.job, "capture")
                elif os.path.lexists(error):
                    self._error_event(rank, capture_id, reg.pid, self._reason(error), job=reg.job)
                else:
                    continue
                del pending[rank]
            if not pending or time.monotonic() >= deadline or self._stop.wait(ANSWER_POLL_S):
                break
        for rank, reg in sorted(pending.items()):
            self._fail(f"capture {capture_id}: rank {rank} (pid {reg.pid}) gave no dump")
            why = f"no Flight Recorder dump within {self.cfg.wait_s:g}s"
            self._error_event(rank, capture_id, reg.pid, why, job=reg.job)

    def _stopped_pids(self) -> set[int]:
        try:
            return {p.pid for p in self.discover() if p.state in STOPPED_STATES}
        except Exception as exc:
            self._fail(f"process discovery failed: {exc}")
            return set()

    def _reason(self, path: Path) -> str:
        """The one line a rank wrote instead of its dump."""
        try:
            text = read_regular(path, 8192)[0].decode("utf-8", "replace")
        except (OSError, ValueError) as exc:
            return f"the rank could not dump (its reason is unreadable: {exc})"
        return " ".join(text.split())[:4096] or "the rank could not dump (no reason given)"

    def sweep_stale(self) -> None:
        """Delete requests and dump directories older than :data:`STALE_S` (a crashed exporter's,
        or an answer that landed after its capture gave up)."""
        now = time.time()
        for sub in ("requests", "dumps"):
            try:
                entries = list((self.dir / sub).iterdir())
            except OSError:
                continue
            for p in entries:
                if _age_s(p, now) <= STALE_S:
                    continue
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)

    # -- timeout dumps -------------------------------------------------------------------------
    def scan_timeouts(self) -> int:
        """One pass over ``timeout/``: publish the dumps that have settled; returns how many."""
        tdir = self.dir / "timeout"
        try:
            names = [e.name for e in os.scandir(tdir) if e.is_file(follow_symlinks=False)]
        except OSError:
            return 0
        now, done, seen = time.monotonic(), 0, set()
        jobs: dict[int, str] | None = None
        for name in sorted(names):
            m = TIMEOUT_DUMP.fullmatch(name)
            if m is None:  # hidden, temporary, or not PyTorch's: leave it alone
                continue
            seen.add(name)
            if self._settled(tdir / name, name, now):
                if jobs is None:  # the job of a rank, when this exporter serves any job
                    regs = read_registrations(self.dir / "ranks", self.alive, self.cfg.registration_fresh_s)
                    jobs = {r: reg.job for r, reg in regs.items()}
                rank = int(m.group(1))
                self._take_timeout_dump(tdir / name, rank, jobs.get(rank, ""))
                self._settling.pop(name, None)
                done += 1
        self._settling = {k: v for k, v in self._settling.items() if k in seen}
        return done

    def _settled(self, path: Path, name: str, now: float) -> bool:
        """True once the file's size and mtime have stayed the same for ``settle_s``."""
        try:
            st = path.lstat()
        except OSError:
            return False
        size, mtime, since = self._settling.get(name, (-1, -1, now))
        if (size, mtime) != (st.st_size, st.st_mtime_ns):
            self._settling[name] = (st.st_size, st.st_mtime_ns, now)
            since = now
        return now - since >= self.cfg.settle_s

    def _take_timeout_dump(self, path: Path, rank: int, job: str) -> None:
        if self._dump_event(path, rank, "", 0, job, "timeout"):
            path.unlink(missing_ok=True)
            return
        bad = path.parent / "bad"
        try:
            bad.mkdir(exist_ok=True)
            os.replace(path, bad / f"{path.name}.{now_ms()}")
        except OSError as exc:  # cannot keep it: drop it rather than report it every round
            self._fail(f"cannot move {path} to {bad}: {exc}")
            path.unlink(missing_ok=True)

    def _poll_timeouts(self) -> None:
        while not self._stop.wait(self.cfg.timeout_poll_s):
            try:
                self.scan_timeouts()
                self.sweep_stale()
            except Exception as exc:
                self._fail(f"timeout dump scan failed: {type(exc).__name__}: {exc}")

    # -- lifecycle -----------------------------------------------------------------------------
    def health(self) -> SourceHealth:
        return SourceHealth(
            name="flight_recorder",
            ok=True,
            last_success_ms=now_ms(),
            error_count=self.errors,
            last_error=self.last_error,
        )

    def start(self) -> None:
        """Start collecting PyTorch's timeout dumps (captures need no start)."""
        self._poller = threading.Thread(target=self._poll_timeouts, name="fr-timeouts", daemon=True)
        self._poller.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for t in [*self._threads, *([self._poller] if self._poller else [])]:
            t.join(timeout_s)
