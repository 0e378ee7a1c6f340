"""Prometheus metrics of the node exporter, served on ``metrics.host:metrics.port`` (``/metrics``).

What Prometheus alerts on is the exporter's own health, seen from outside the Kafka path it
reports on: a source that stopped succeeding (``..._source_last_success_timestamp_seconds``
against ``..._source_interval_seconds``), a spool that grows while Kafka is away, records
dropped.  The heartbeat carries the same source health to the stream workers; this is the view
that still works when Kafka does not.

Label values are bounded: ``source`` is a registered source name, ``topic`` a registry topic,
``reason`` one of :data:`DROP_REASONS`.  The last error's text is a label of
``trainguard_exporter_source_last_error_info`` cut to :data:`ERROR_TEXT_MAX` characters, one
series per source at a time (a new error replaces the previous one's series), so a source whose
errors carry changing numbers cannot grow the series count.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from trainguard.streams.exporter.sources.reporter import REASONS as REPORTER_REASONS

#: why a record the exporter took in is gone: the spool's size bound dropped its oldest segment;
#: the reporter's in-memory queue was full; the reporter refused a datagram or event (per reason).
DROP_REASONS = ("spool_full", "reporter_queue_full", *(f"reporter_{r}" for r in REPORTER_REASONS))
#: the last error's text in its info series is cut to this many characters.
ERROR_TEXT_MAX = 120
#: outcomes of a source's round (``outcome`` label of the collections counter).
OK, ERROR = "ok", "error"


@dataclass
class ExporterMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.collections = Counter(
            "trainguard_exporter_collections_total",
            "Rounds of a source, by outcome (ok: collected and spooled; error: raised, logged, reported)",
            ["source", "outcome"],
            registry=r,
        )
        self.collection_seconds = Histogram(
            "trainguard_exporter_collection_seconds",
            "Duration of a source's round (collect, spool, commit), failed rounds included",
            ["source"],
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.source_up = Gauge(
            "trainguard_exporter_source_up",
            "1 if the source's last round succeeded, else 0",
            ["source"],
            registry=r,
        )
        self.last_success = Gauge(
            "trainguard_exporter_source_last_success_timestamp_seconds",
            "Unix time of the source's last successful round (0: none yet)",
            ["source"],
            registry=r,
        )
        self.last_error_ts = Gauge(
            "trainguard_exporter_source_last_error_timestamp_seconds",
            "Unix time of the source's last failed round (0: none yet)",
            ["source"],
            registry=r,
        )
        self.last_error = Gauge(
            "trainguard_exporter_source_last_error_info",
            f"The source's last error (type: message, cut to {ERROR_TEXT_MAX} characters) in the "
            "error label; always 1, one series per source",
            ["source", "error"],
            registry=r,
        )
        self.interval = Gauge(
            "trainguard_exporter_source_interval_seconds",
            "The source's sampling interval now (changed at runtime by set-interval commands)",
            ["source"],
            registry=r,
        )
        self.spool_records = Gauge(
            "trainguard_exporter_spool_records",
            "Records in the spool, not yet acknowledged by Kafka",
            registry=r,
        )
        self.spool_bytes = Gauge(
            "trainguard_exporter_spool_bytes", "Bytes of the spool's segments on disk", registry=r
        )
        self.spooled = Counter(
            "trainguard_exporter_records_spooled_total", "Records appended to the spool", registry=r
        )
        self.published = Counter(
            "trainguard_exporter_records_published_total",
            "Records Kafka acknowledged (then deleted from the spool)",
            ["topic"],
            registry=r,
        )
        self.dropped = Counter(
            "trainguard_exporter_records_dropped_total",
            "Records taken in but never published: spool over its bound, reporter queue full or refusals",
            ["reason"],
            registry=r,
        )
        self.delivery_errors = Counter(
            "trainguard_exporter_delivery_errors_total",
            "Failed or stuck sends to Kafka (the unacknowledged records stay spooled and are sent again)",
            registry=r,
        )
        self.kafka_connected = Gauge(
            "trainguard_exporter_kafka_connected",
            "1 if the last delivery round reached Kafka, else 0",
            registry=r,
        )
        for reason in DROP_REASONS:  # every series exists from the start: rate() sees the first drop
            self.dropped.labels(reason)
        self._lock = threading.Lock()
        #: source -> the error label of its last-error series (removed when the next error comes).
        self._errors: dict[str, str] = {}

    # -- sources -------------------------------------------------------------------------------
    def source(self, name: str, interval_s: float) -> None:
        """An enabled source: its series exist (at 0) before its first round."""
        for outcome in (OK, ERROR):
            self.collections.labels(name, outcome)
        self.last_success.labels(name).set(0)
        self.last_error_ts.labels(name).set(0)
        self.interval.labels(name).set(interval_s)

    def collected(self, name: str, seconds: float) -> None:
        self.collections.labels(name, OK).inc()
        self.collection_seconds.labels(name).observe(seconds)
        self.source_up.labels(name).set(1)
        self.last_success.labels(name).set(time.time())

    def failed(self, name: str, seconds: float, exc: BaseException) -> None:
        self.collections.labels(name, ERROR).inc()
        self.collection_seconds.labels(name).observe(seconds)
        self.source_up.labels(name).set(0)
        self.last_error_ts.labels(name).set(time.time())
        text = f"{type(exc).__name__}: {exc}"[:ERROR_TEXT_MAX]
        with self._lock:
            old = self._errors.get(name)
            if old is not None and old != text:
                self.last_error.remove(name, old)
            self._errors[name] = text
            self.last_error.labels(name, text).set(1)

    # -- spool and delivery --------------------------------------------------------------------
    def watch_spool(self, records: Callable[[], int], size: Callable[[], int]) -> None:
        """The spool's depth, read at every scrape."""
        self.spool_records.set_function(records)
        self.spool_bytes.set_function(size)

    def watch_connection(self, connected: Callable[[], bool]) -> None:
        self.kafka_connected.set_function(lambda: 1.0 if connected() else 0.0)

    def drop(self, reason: str, n: int = 1) -> None:
        """``n`` records lost for ``reason`` (one of :data:`DROP_REASONS`)."""
        if n > 0:
            self.dropped.labels(reason).inc(n)
