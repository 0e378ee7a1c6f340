"""Progress of long-running commands on stderr (``stack up``, ``record``, ``replay``, the benches).

Not the action service's recovery progress (that is :mod:`trainguard.actions.progress`): this is what an
operator watching a terminal, or reading a CI log, sees while a command works.

* On a terminal: one line rewritten in place -- the phase, done / total, percent, elapsed time,
  rate, ETA, then a detail -- cut to the terminal's width (a wrapped line cannot be rewritten
  with ``\\r``); a phase that took a while leaves its final line above it.
* Not on a terminal (a pipe, a CI log, ``TERM=dumb``): no carriage returns, no escapes; one plain
  line every ``TRAINGUARD_PROGRESS_INTERVAL`` seconds (default 10) while the work runs, and one
  line at the end, so a short run adds a single line to a log and a long one a line per
  interval.  (A command that prints its own summary, like ``stack up``, skips that last line.)
* Always on stderr (or the stream given): stdout stays what scripts parse (``--json`` output,
  the bench tables).
* Off with ``TRAINGUARD_PROGRESS=0`` (``trainguard --quiet`` passes ``enabled=False``): every
  method is then a no-op, so callers never test whether progress is wanted.

Why not ``click.progressbar``: off a terminal it prints its label once and then nothing until the
end (CI sees silence for the minutes a Maven download or a Go build takes); it knows only
"items of a known length", not phases (``stack up``'s jar resolving, then starting, then
waiting), a free-text detail (artifacts downloaded) or the time passing while the caller blocks
in a subprocess; and it lives in the CLI library, which the infra layer (the stack, the
recorder) does not import.  tqdm or rich would do most of it, at the price of a dependency for
what a few hundred lines here do.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from types import TracebackType
from typing import TextIO, TypeVar

#: ``0`` (or off / false / no) turns progress off for every command.
ENV = "TRAINGUARD_PROGRESS"
#: seconds between two plain lines when stderr is not a terminal.
INTERVAL_ENV = "TRAINGUARD_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 10.0
#: a terminal line is redrawn at most this often (fast loops call update() per record).
REFRESH_S = 0.2

T = TypeVar("T")


def enabled_by_env(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(ENV, "1").strip().lower() not in {"0", "off", "false", "no"}


def interval_from_env(environ: Mapping[str, str] = os.environ) -> float:
    try:
        return max(0.0, float(environ[INTERVAL_ENV]))
    except (KeyError, ValueError):
        return DEFAULT_INTERVAL_S


def fmt_duration(seconds: float) -> str:
    """``0.4s``, ``12s``, ``3m05s``, ``1h02m``: short enough for a status line."""
    s = max(0.0, seconds)
    if s < 10:
        return f"{s:.1f}s"
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        m, sec = divmod(int(s), 60)
        return f"{m}m{sec:02d}s"
    h, rest = divmod(int(s), 3600)
    return f"{h}h{rest // 60:02d}m"


def fmt_number(x: float) -> str:
    if float(x).is_integer():
        return f"{int(x):,}"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def fmt_rate(per_s: float, unit: str = "") -> str:
    """Items per second; under one a second, the time each takes (``21m each`` for demo runs)."""
    if per_s >= 1:
        return f"{fmt_number(round(per_s) if per_s >= 100 else per_s)}{' ' + unit if unit else ''}/s"
    return f"{fmt_duration(1 / per_s)} each" if per_s > 0 else ""


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """One long-running piece of work: optional phases, a count against an optional total.

    Thread-safe: :meth:`ticking` redraws from a thread of its own (so the elapsed time moves while
    the caller blocks), and callers may update from worker threads.
    """

    def __init__(
        self,
        label: str,
        total: float | None = None,
        unit: str = "",
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        tty: bool | None = None,
        interval_s: float | None = None,
        keep_phase_s: float = 2.0,
        summary: bool = True,
        rate: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        #: what leaving the ``with`` block prints: a final line (see :meth:`close`), or only the
        #: last phase's when it was slow (a caller that prints its own summary on stdout).
        self.summary = summary
        #: show the rate (off for a count of seconds: "1.00 s/s" says nothing; the ETA stays).
        self.show_rate = rate
        self.stream = stream if stream is not None else sys.stderr
        # The environment can only turn it off: a library caller's enabled=True does not beat the
        # operator's TRAINGUARD_PROGRESS=0.
        self.enabled = enabled is not False and enabled_by_env()
        if tty is None:  # a dumb terminal shows escapes as garbage: it gets the log's lines
            tty = _is_tty(self.stream) and os.environ.get("TERM") != "dumb"
        self.tty = tty
        self.interval_s = interval_from_env() if interval_s is None else interval_s
        #: a phase that lasted this long leaves its final line (on a terminal; in a log: a phase
        #: that lasted one interval, i.e. one that showed up in the log while it ran).
        self.keep_phase_s = keep_phase_s if self.tty else self.interval_s
        self._clock = clock
        self._lock = threading.RLock()
        self.started = clock()
        self.phase_name = ""
        self.phase_started = self.started
        self.done = 0.0
        self.total = total
        self.unit = unit
        self.detail = ""
        self._last_out = self.started  # the run's start counts as said: the first line waits
        self._drawn = False  # a terminal line is on screen and needs clearing before other text
        self._closed = False

    # -- what the work reports --------------------------------------------------------------------
    def phase(self, name: str, total: float | None = None, unit: str = "") -> None:
        """A new step of the work, with a count of its own (of ``unit``; none: it only takes
        time); its count, total, detail and clock start from zero."""
        if not self.enabled:
            return
        with self._lock:
            self._end_phase()
            now = self._clock()
            self.phase_name, self.phase_started = name, now
            self.done, self.total, self.unit, self.detail = 0.0, total, unit, ""
            if self.tty:
                self._draw(now)

    def update(
        self,
        done: float | None = None,
        *,
        advance: float = 0,
        total: float | None = None,
        detail: str | None = None,
    ) -> None:
        if not self.enabled:
            return
        with self._lock:
            if done is not None:
                self.done = done
            self.done += advance
            if total is not None:
                self.total = total
            if detail is not None:
                self.detail = detail
            self._maybe_out()

    def advance(self, n: float = 1) -> None:
        self.update(advance=n)

    def iter(self, items: Iterable[T]) -> Iterator[T]:
        """Yield ``items``, counting each once it has been processed (the loop body ran)."""
        if self.enabled and self.total is None and isinstance(items, Sized):
            self.update(total=len(items))
        for item in items:
            yield item
            self.advance()

    def tick(self) -> None:
        """Redraw if due (the elapsed time moved): what :meth:`ticking`'s thread calls."""
        if self.enabled:
            with self._lock:
                self._maybe_out()

    @contextlib.contextmanager
    def ticking(self, every_s: float | None = None) -> Iterator[Progress]:
        """Keep the line moving while the caller blocks (a subprocess, a server start-up)."""
        if not self.enabled:
            yield self
            return
        stop = threading.Event()
        every = every_s if every_s is not None else (REFRESH_S * 2.5 if self.tty else 1.0)

        def loop() -> None:
            while not stop.wait(every):
                self.tick()

        thread = threading.Thread(target=loop, name=f"progress-{self.label}", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()

    # -- other text -------------------------------------------------------------------------------
    def note(self, text: str) -> None:
        """A message of its own line (a terminal's status line is redrawn below it)."""
        if not self.enabled:
            return
        with self._lock:
            self._clear()
            self._write(text + "\n")
            if self.tty and not self._closed:
                self._draw(self._clock())

    def echo(self, text: str, file: TextIO | None = None) -> None:
        """``print(text, file=file, flush=True)`` -- the program's own output, written whether or
        not progress is on -- without the terminal's status line in the middle of it."""
        out = file if file is not None else sys.stdout
        with self._lock:
            if self.enabled:
                self._clear()
            print(text, file=out, flush=True)
            if self.enabled and self.tty and not self._closed:
                self._draw(self._clock())

    def close(self, summary: bool | None = None) -> None:
        """End the work: with ``summary`` (default: the constructor's) one final line (the run's
        time, the last phase's count and rate), else only the last phase's line if it was slow."""
        if not self.enabled:
            return
        summary = self.summary if summary is None else summary
        with self._lock:
            if self._closed:
                return
            if summary:
                self._clear()
                self._write(self.render("final") + "\n")
            else:
                self._end_phase()
                self._clear()
            self._closed = True

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
            return
        if not self.enabled:
            return
        with self._lock:  # where it stopped (if it showed for a while): the error message follows
            self._keep_line(" (stopped)")
            self._clear()
            self._closed = True

    # -- the line ---------------------------------------------------------------------------------
    def render(self, how: str = "running") -> str:
        """The status line: ``running`` (the phase so far, with an ETA), ``ended`` (the phase,
        done) or ``final`` (the whole run's time, the last phase's count and rate)."""
        final = how == "final"
        now = self._clock()
        elapsed = now - (self.started if final else self.phase_started)
        head = self.label + (f": {self.phase_name}" if self.phase_name and not final else "")
        unit = f" {self.unit}" if self.unit else ""
        count = ""
        if self.total and (how == "running" or self.done != self.total):
            pct = min(100.0, 100 * self.done / self.total)
            count = f": {fmt_number(self.done)}/{fmt_number(self.total)}{unit} ({pct:.0f}%)"
        elif self.done or (self.unit and how != "running"):  # done, or no total known
            count = f": {fmt_number(self.done)}{unit}"
        timing = fmt_duration(elapsed) if how == "running" else f"in {fmt_duration(elapsed)}"
        # The count's rate over its phase, also in the final line: a run's set-up (connecting,
        # counting) is not part of its throughput.
        counted = now - self.phase_started
        rate = self.done / counted if counted > 0 and self.done > 0 else 0.0
        if rate:
            timing += f", {fmt_rate(rate, self.unit)}" if self.show_rate else ""
            if how == "running" and self.total and self.total > self.done:
                timing += f", ETA {fmt_duration((self.total - self.done) / rate)}"
        # The detail last: a narrow terminal cuts it before the time and the ETA.  Not in the
        # final line: it describes a moment of the work, not its end.
        detail = f"  {self.detail}" if self.detail and not final else ""
        return f"{head}{count}  [{timing}]{detail}"

    def _maybe_out(self) -> None:
        if self._closed:
            return
        now = self._clock()
        if self.tty:
            if now - self._last_out >= REFRESH_S or not self._drawn:
                self._draw(now)
        elif now - self._last_out >= self.interval_s:
            self._write(self.render() + "\n")
            self._last_out = now

    def _draw(self, now: float) -> None:
        width = shutil.get_terminal_size((100, 24)).columns - 1
        self._write("\r" + self.render()[:width] + "\x1b[K")
        self._drawn = True
        self._last_out = now

    def _clear(self) -> None:
        if self.tty and self._drawn:
            self._write("\r\x1b[K")
            self._drawn = False

    def _end_phase(self) -> None:
        if self.phase_name:
            self._keep_line()

    def _keep_line(self, suffix: str = "") -> None:
        """Leave the phase's final line when it took a while (a short one just goes away)."""
        if self._clock() - self.phase_started >= self.keep_phase_s:
            self._clear()
            self._write(self.render("ended") + suffix + "\n")
            self._last_out = self._clock()

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: progress never fails the work
            self.enabled = False


def quiet() -> Progress:
    """A progress that shows nothing (for callers that report on their own, and tests)."""
    return Progress("", enabled=False)
