"""Runs the enabled sources, each on its own interval, and keeps their health.

Each source gets its own thread so a slow one (NVML stuck on a dying GPU, a huge kernel log)
never delays the others; intervals can change at runtime (:meth:`Exporter.set_interval`, from
the command topic).  Every ``collect()`` is wrapped like node_exporter's ``execute()``: an
exception is logged with the source name and becomes that source's health entry in the next
heartbeat -- never a crash.  After a round's events are handed to ``publish`` (the spool), the
source's optional ``commit()`` runs, so positions (kernel log) only move past spooled lines.
Every round also lands in the exporter's Prometheus metrics (:mod:`trainguard.streams.exporter.metrics`):
its outcome, duration and time, and the error of a failed one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.telemetry import SourceHealth
from trainguard.streams.exporter.config import ExporterConfig
from trainguard.streams.exporter.metrics import ExporterMetrics
from trainguard.streams.exporter.ranks import RankRegistry
from trainguard.streams.exporter.sources import REGISTRY, Source, SourceContext, enabled_sources
from trainguard.streams.exporter.sources.base import section

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.01


@dataclass
class _Health:
    ok: bool = True
    last_success_ms: int = 0
    error_count: int = 0
    duration_ms: float = 0.0
    last_error: str = ""
    rounds: int = 0

    def snapshot(self, name: str) -> SourceHealth:
        return SourceHealth(
            name=name,
            ok=self.ok,
            last_success_ms=self.last_success_ms,
            error_count=self.error_count,
            duration_ms=round(self.duration_ms, 3),
            last_error=self.last_error[:4096],
        )


class Exporter:
    """The sources of one node and their schedule; events go to ``publish``."""

    def __init__(
        self,
        cfg: ExporterConfig,
        publish: Callable[[Event], None],
        *,
        nvml: Any = None,
        once: bool = False,
        extra_health: Iterable[Callable[[], SourceHealth]] = (),
        metrics: ExporterMetrics | None = None,
        ranks: RankRegistry | None = None,
    ) -> None:
        self.cfg = cfg
        self.publish = publish
        self.extra_health = list(extra_health)
        self.metrics = metrics or ExporterMetrics()
        state_dir = None if once else Path(cfg.state_dir)
        if state_dir is not None:
            state_dir.mkdir(parents=True, exist_ok=True)
        #: the ranks launchers registered here (the service shares it with its captures).
        # `is None`, not `or`: the service's registry is empty (falsy: it has a length) when it is
        # handed over, and a new one here would leave the captures following nobody.
        if ranks is None:
            ranks = RankRegistry(cfg.process.max_registered, cfg.process.registered_linger_s)
        self.ranks = ranks
        ctx = SourceContext(
            cfg,
            state_dir=state_dir,
            health=self.health,
            nvml=nvml,
            once=once,
            dropped=self.metrics.drop,
            ranks=self.ranks,
        )
        self._lock = threading.Lock()
        self._health: dict[str, _Health] = {}
        self.sources: dict[str, Source] = {}
        for name in enabled_sources(cfg):
            self._health[name] = _Health()
            self.metrics.source(name, float(section(cfg, name).interval_s))
            try:
                self.sources[name] = REGISTRY[name].factory(ctx)
            except Exception as exc:  # a source that cannot even be built is reported, like a failing one
                log.exception("source %s could not start", name)
                self._fail(name, exc, 0.0)
        self.intervals = {name: float(section(cfg, name).interval_s) for name in self.sources}
        self._stop = threading.Event()
        self._wake = {name: threading.Event() for name in self.sources}
        self._threads: list[threading.Thread] = []

    # -- health --------------------------------------------------------------------------------
    def _fail(self, name: str, exc: BaseException, duration_ms: float) -> None:
        with self._lock:
            h = self._health[name]
            h.ok, h.duration_ms = False, duration_ms
            h.error_count += 1
            h.last_error = f"{type(exc).__name__}: {exc}"
        self.metrics.failed(name, duration_ms / 1000, exc)

    def health(self) -> list[SourceHealth]:
        with self._lock:
            out = [h.snapshot(name) for name, h in self._health.items()]
        for extra in self.extra_health:
            try:
                out.append(extra())
            except Exception as exc:
                log.warning("health hook failed: %s", exc)
        return out

    # -- rounds --------------------------------------------------------------------------------
    def run_source(self, name: str) -> list[Event]:
        """One round of one source: collect, publish, commit; failures become health."""
        src = self.sources[name]
        t0 = time.perf_counter()
        try:
            events = src.collect()
            for ev in events:
                self.publish(ev)
            commit = getattr(src, "commit", None)
            if commit is not None:
                commit()
        except Exception as exc:
            duration = (time.perf_counter() - t0) * 1000
            log.warning(
                "source %s failed: %s: %s",
                name,
                type(exc).__name__,
                exc,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            self._fail(name, exc, duration)
            return []
        duration = (time.perf_counter() - t0) * 1000
        with self._lock:
            h = self._health[name]
            h.ok, h.last_success_ms, h.duration_ms, h.last_error = True, now_ms(), duration, ""
            h.rounds += 1
        self.metrics.collected(name, duration / 1000)
        return events

    def run_once(self) -> list[Event]:
        """One round of every enabled source (heartbeat last, so it sees this round's health)."""
        out: list[Event] = []
        for name in self.sources:
            out += self.run_source(name)
        return out

    # -- background schedule -------------------------------------------------------------------
    def set_interval(self, name: str, seconds: float) -> None:
        if name not in self.sources:
            raise ValueError(f"no enabled source {name!r} (enabled: {', '.join(self.sources)})")
        if not MIN_INTERVAL_S <= seconds <= 86_400:
            raise ValueError(f"interval {seconds!r} s outside [{MIN_INTERVAL_S}, 86400]")
        self.intervals[name] = float(seconds)
        self.metrics.interval.labels(name).set(seconds)
        self._wake[name].set()  # re-plan now rather than after the old (maybe long) interval
        log.info("source %s interval set to %.3f s", name, seconds)

    def _loop(self, name: str) -> None:
        wake = self._wake[name]
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.run_source(name)
            while not self._stop.is_set():
                remaining = self.intervals[name] - (time.monotonic() - t0)
                if remaining <= 0:
                    break
                if wake.wait(remaining):
                    wake.clear()  # the interval changed: recompute the wait from the same t0

    def start(self) -> None:
        for name in self.sources:
            t = threading.Thread(target=self._loop, args=(name,), name=f"source-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        for ev in self._wake.values():
            ev.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for name, src in self.sources.items():
            try:
                src.close()
            except Exception as exc:
                log.warning("closing source %s: %s", name, exc)
