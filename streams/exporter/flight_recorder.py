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
once PyTorch has finished writing them, published (trigger ``timeout``) and deleted; each is moved
to ``timeout/bad/`` (the exporter's own, mode 0700) *before* it is parsed and deleted from there
once published, so a dump that kills the parse stays there instead of being taken again on every
start; an unreadable one stays too (the newest :data:`MAX_QUARANTINED`).  Errors never stop the
exporter: they are logged and counted.

The directory is written by the ranks, so nothing in it is trusted: it is used only through
descriptors, no link followed anywhere in it (:mod:`trainguard.streams.exporter.shared_dir`) -- a
link put in place of ``dumps/`` or ``dumps/<capture_id>`` is removed as a link, and the sweeps
never delete anything outside the directory -- and each dump is parsed within a budget
(:class:`trainguard.detectors.flight_recorder.load.Budget`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainguard.detectors.flight_recorder import FlightRecorderError, dump_to_event, parse_dump
from trainguard.infra.proctable import DEAD_STATES, JOB_CONTROL_STOP, LIVE
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.enums import ProcessRole
from trainguard.schemas.telemetry import SourceHealth
from trainguard.schemas.workload import FlightRecorderDump
from trainguard.streams.exporter import shared_dir
from trainguard.streams.exporter.config import FlightRecorderConfig
from trainguard.streams.exporter.shared_dir import SharedDir
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
#: timeout dumps kept in ``timeout/bad/`` (unreadable ones, or one whose parse never returned):
#: the newest, for an operator to look at; older ones are deleted.
MAX_QUARANTINED = 16
NOT_ENABLED = "Flight Recorder not enabled in this rank (no reporter registration)"


@dataclass(frozen=True)
class Registration:
    """A rank's reporter, as its ``ranks/<R>.json`` says."""

    rank: int
    pid: int
    job: str


def read_registrations(
    fr: SharedDir, alive: Callable[[int], bool], fresh_s: float = 0.0
) -> dict[int, Registration]:
    """The registrations in ``<fr>/ranks/`` of live processes, by rank (a dead pid's file is a
    killed rank's).  A rank whose pid is not alive here but whose file was refreshed within
    ``fresh_s`` counts as live too: its pid is in another pid namespace (a training pod without
    ``hostPID``)."""
    now = time.time()
    out: dict[int, Registration] = {}
    try:
        with fr.dir("ranks") as fd:
            for name, _st in shared_dir.entries(fd):
                if not name.endswith(".json") or name.startswith("."):
                    continue
                try:
                    raw, mtime_ms = shared_dir.read_file(fd, name, 4096)
                    doc = json.loads(raw)
                    reg = Registration(int(doc["rank"]), int(doc["pid"]), str(doc.get("job") or ""))
                except (OSError, ValueError, TypeError, KeyError) as exc:
                    log.warning("flight recorder: ignoring registration %s: %s", name, exc)
                    continue
                fresh = fresh_s > 0 and now - mtime_ms / 1000 <= fresh_s
                if reg.rank >= 0 and reg.pid > 0 and (alive(reg.pid) or fresh):
                    out[reg.rank] = reg
    except FileNotFoundError:
        pass
    except OSError as exc:  # a link in place of ranks/: no registration is read through it
        log.warning("flight recorder: registrations not read: %s", exc)
    return out


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
        self.shared = SharedDir(self.dir)
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

    def _dump_event(
        self, dir_fd: int, name: str, rank: int, capture_id: str, pid: int, job: str, trigger: str
    ) -> bool:
        """Publish the dump ``name`` of directory ``dir_fd`` (True), or an error event saying
        why it is unreadable (False)."""
        try:
            data, mtime_ms = shared_dir.read_file(dir_fd, name, self.cfg.max_bytes)
            event = dump_to_event(
                parse_dump(data, rank, name),
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
            why = str(exc) if isinstance(exc, FlightRecorderError) else f"{name}: {exc}"
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
        registered = read_registrations(self.shared, self.alive, self.cfg.registration_fresh_s)
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
        try:
            if registered:
                with self.shared.dir("requests", create=True) as fd:
                    body = {"capture_id": capture_id, "ts_ms": now_ms(), "ranks": sorted(registered)}
                    shared_dir.write_file(fd, capture_id, json.dumps(body).encode())
                self._collect_answers(capture_id, registered)
        except OSError as exc:
            self._fail(f"capture {capture_id}: {exc}")
            for rank, reg in registered.items():
                why = f"Flight Recorder request failed: {exc}"
                self._error_event(rank, capture_id, reg.pid, why, job=reg.job)
        finally:
            self._remove("requests", capture_id)
            self._remove("dumps", capture_id)
        self.captures += 1
        log.info(
            "flight recorder capture %s: %d registered, %d unregistered rank(s), %.2f s",
            capture_id,
            len(registered),
            len(unregistered),
            time.monotonic() - started,
        )
        return len(registered) + len(unregistered)

    def _collect_answers(self, capture_id: str, registered: dict[int, Registration]) -> None:
        """Publish each rank's answer as it lands in ``dumps/<capture_id>/``; after ``wait_s``,
        an error for the silent ones.  A link in place of either directory is never followed:
        no answer is read through it (the ranks then count as silent)."""
        pending = dict(registered)
        deadline = time.monotonic() + self.cfg.wait_s
        # A stopped rank (SIGSTOP) runs none of its own code, so it cannot write its dump: say so
        # now instead of after wait_s -- the capture waits for every rank's answer.  A rank in a
        # tracing stop is waited for: the same capture's py-spy pauses each rank it dumps, and
        # taking that pause for a stop lost the one dump that named a hang's culprit (the
        # own-job bench: a SIGSTOPped rank's peer answered "stopped" too, and the capture was
        # judged healthy).  A debugger's stop that lasts gets "no dump within wait_s".
        stopped = self._stopped_pids()
        for rank, reg in sorted(pending.items()):
            if reg.pid in stopped:
                why = "the rank's process is stopped (state T): it cannot write its Flight Recorder"
                self._error_event(rank, capture_id, reg.pid, why, job=reg.job)
                del pending[rank]
        unsafe = ""
        while pending:
            try:
                with self.shared.dir("dumps", capture_id) as fd:
                    self._take_answers(fd, capture_id, pending)
            except FileNotFoundError:
                pass  # no rank answered yet
            except shared_dir.UnsafeEntry as exc:
                if not unsafe:
                    unsafe = str(exc)
                    self._fail(f"capture {capture_id}: {exc}")
            if not pending or time.monotonic() >= deadline or self._stop.wait(ANSWER_POLL_S):
                break
        for rank, reg in sorted(pending.items()):
            self._fail(f"capture {capture_id}: rank {rank} (pid {reg.pid}) gave no dump")
            why = f"no Flight Recorder dump within {self.cfg.wait_s:g}s"
            self._error_event(rank, capture_id, reg.pid, why, job=reg.job)

    def _stopped_pids(self) -> set[int]:
        try:
            return {p.pid for p in self.discover() if p.state == JOB_CONTROL_STOP}
        except Exception as exc:
            self._fail(f"process discovery failed: {exc}")
            return set()

    def _take_answers(self, fd: int, capture_id: str, pending: dict[int, Registration]) -> None:
        for rank, reg in list(pending.items()):
            dump, error = f"rank_{rank}", f"rank_{rank}.error"
            if shared_dir.exists(fd, dump):
                self._dump_event(fd, dump, rank, capture_id, reg.pid, reg.job, "capture")
            elif shared_dir.exists(fd, error):
                self._error_event(rank, capture_id, reg.pid, self._reason(fd, error), job=reg.job)
            else:
                continue
            del pending[rank]

    def _reason(self, fd: int, name: str) -> str:
        """The one line a rank wrote instead of its dump."""
        try:
            text = shared_dir.read_file(fd, name, 8192)[0].decode("utf-8", "replace")
        except (OSError, ValueError) as exc:
            return f"the rank could not dump (its reason is unreadable: {exc})"
        return " ".join(text.split())[:4096] or "the rank could not dump (no reason given)"

    def _remove(self, sub: str, name: str) -> None:
        """Remove ``<sub>/<name>`` (a link as a link; nothing if ``sub`` itself is not a real
        directory); an error is counted, never raised."""
        try:
            with self.shared.dir(sub) as fd:
                shared_dir.remove(fd, name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._fail(f"cannot remove {sub}/{name}: {exc}")

    def sweep_stale(self) -> None:
        """Delete requests and dump directories older than :data:`STALE_S` (a crashed exporter's,
        or an answer that landed after its capture gave up).  Inside the directory only: a link
        in place of ``requests/`` or ``dumps/`` is removed (the link, not its target), a link in
        them is removed as a link, and a directory in them with everything in it, no link
        followed."""
        now = time.time()
        for sub in ("requests", "dumps"):
            try:
                with self.shared.dir(sub) as fd:
                    for name, st in shared_dir.entries(fd):
                        if now - st.st_mtime > STALE_S:
                            shared_dir.remove(fd, name)
            except FileNotFoundError:
                continue
            except shared_dir.UnsafeEntry as exc:
                self._fail(f"{exc}: removed")
                try:
                    with self.shared.dir() as base:
                        shared_dir.remove(base, sub)  # only the name: a link, or a stray file
                except OSError as again:
                    self._fail(f"cannot remove {sub}: {again}")
            except OSError as exc:
                self._fail(f"sweeping {sub}: {exc}")

    # -- timeout dumps -------------------------------------------------------------------------
    def scan_timeouts(self) -> int:
        """One pass over ``timeout/``: publish the dumps that have settled; returns how many."""
        try:
            with self.shared.dir("timeout") as tfd:
                return self._scan_timeouts(tfd)
        except FileNotFoundError:
            return 0
        except OSError as exc:  # a link in place of timeout/: nothing is read through it
            self._fail(f"timeout dumps not read: {exc}")
            return 0

    def _scan_timeouts(self, tfd: int) -> int:
        now, done, seen = time.monotonic(), 0, set()
        jobs: dict[int, str] | None = None
        for name, st in shared_dir.entries(tfd):
            m = TIMEOUT_DUMP.fullmatch(name)
            if m is None or not stat.S_ISREG(st.st_mode):  # hidden, temporary, a link, not PyTorch's
                continue
            seen.add(name)
            if self._settled(name, st, now):
                if jobs is None:  # the job of a rank, when this exporter serves any job
                    regs = read_registrations(self.shared, self.alive, self.cfg.registration_fresh_s)
                    jobs = {r: reg.job for r, reg in regs.items()}
                rank = int(m.group(1))
                self._take_timeout_dump(tfd, name, rank, jobs.get(rank, ""))
                self._settling.pop(name, None)
                done += 1
        self._settling = {k: v for k, v in self._settling.items() if k in seen}
        return done

    def _settled(self, name: str, st: os.stat_result, now: float) -> bool:
        """True once the file's size and mtime have stayed the same for ``settle_s``."""
        size, mtime, since = self._settling.get(name, (-1, -1, now))
        if (size, mtime) != (st.st_size, st.st_mtime_ns):
            self._settling[name] = (st.st_size, st.st_mtime_ns, now)
            since = now
        return now - since >= self.cfg.settle_s

    def _take_timeout_dump(self, tfd: int, name: str, rank: int, job: str) -> None:
        """Quarantine, then parse: a dump moves to ``timeout/bad/`` first and leaves it only once
        published, so one whose parse never returns (the process killed meanwhile) is not taken
        again on the next start.  No quarantine possible: parsed in place, deleted either way."""
        kept = f"{name}.{now_ms()}"
        try:
            with self.shared.own_dir("timeout", "bad") as bad:
                shared_dir.move(tfd, name, bad, kept)
                if self._dump_event(bad, kept, rank, "", 0, job, "timeout"):
                    shared_dir.remove(bad, kept)
                self._trim_quarantine(bad)
            return
        except OSError as exc:
            self._fail(f"cannot quarantine timeout/{name}: {exc}")
        self._dump_event(tfd, name, rank, "", 0, job, "timeout")
        try:
            shared_dir.remove(tfd, name)
        except OSError as exc:
            self._fail(f"cannot remove timeout/{name}: {exc}")

    def _trim_quarantine(self, bad: int) -> None:
        kept = sorted(shared_dir.entries(bad), key=lambda e: e[1].st_mtime_ns)
        for name, _st in kept[:-MAX_QUARANTINED]:
            shared_dir.remove(bad, name)

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
