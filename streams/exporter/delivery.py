"""Ships spooled records to Kafka (kafka-python, batched, compressed, idempotent producer).

``publish(event)`` encodes the event, picks its topic and record key from the registry
(``trainguard.schemas.topics``) and appends it to the
:class:`~trainguard.streams.exporter.spool.Spool` -- that is all a
sampling thread ever does.  One delivery thread takes sealed segments oldest first, sends every
record, and deletes a segment only once every record in it is acknowledged.  While the broker is
away the producer retries internally (idempotence on: its retries add no duplicates); a record
whose send failed or timed out is sent again.  If the exporter stops with a segment half
delivered, the segment is rewritten with only the unacknowledged records, so a restart re-sends
nothing already acknowledged: duplicates arise only from a crash (at-least-once).

Each record is spooled with a priority (:class:`SpoolPriority`), so that under the spool's size
bound -- a long broker outage -- a kernel line or a line a rule matches outlives any number of
ordinary records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any

from trainguard.detectors.rule_table import RuleTable, default_rule_table
from trainguard.infra.backoff import Backoff
from trainguard.infra.bus import BusError, EventProducer
from trainguard.infra.config import KafkaConfig
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.codec import encode
from trainguard.schemas.telemetry import SourceHealth
from trainguard.schemas.topics import topic_for
from trainguard.schemas.workload import LogLine, ProcessExit
from trainguard.streams.exporter.config import DeliveryConfig
from trainguard.streams.exporter.metrics import ExporterMetrics
from trainguard.streams.exporter.sources.base import KERNEL_SOURCES
from trainguard.streams.exporter.spool import KERNEL, MATCHED, ORDINARY, Record, Spool

log = logging.getLogger(__name__)

#: how long one flush waits before the thread re-checks failed sends and the stop flag.
FLUSH_WAIT_S = 1.0
IDLE_WAIT_S = 0.1
#: wait after a failed connect or delivery, doubling up to MAX_BACKOFF_S.
INITIAL_BACKOFF_S = 0.2
MAX_BACKOFF_S = 5.0


class SpoolPriority:
    """The spool priority of an event: :data:`~trainguard.streams.exporter.spool.KERNEL` for a
    kernel or NVML line, :data:`~trainguard.streams.exporter.spool.MATCHED` for any other line a
    log row of the rule table matches (the rows the ``kernel_log`` source ships by) and for a
    process exit (a recovery starts from each), :data:`~trainguard.streams.exporter.spool.ORDINARY`
    for the rest (telemetry, steps, other lines: the newest of them say the most).

    >>> p = SpoolPriority()
    >>> p(LogLine(node="n", ts_ms=1, source="kernel", line="usb 1-1: new device"))
    2
    >>> p(LogLine(node="n", ts_ms=1, source="stdout", line="CUDA error: an illegal memory access"))
    1
    >>> p(LogLine(node="n", ts_ms=1, source="stdout", line="step 7 loss 2.1"))
    0
    """

    def __init__(self, rules: RuleTable | None = None) -> None:
        self.rules = rules if rules is not None else default_rule_table()

    def __call__(self, event: Event) -> int:
        if isinstance(event, LogLine):
            if event.source in KERNEL_SOURCES:
                return KERNEL
            return MATCHED if self.rules.match_line(event.line) is not None else ORDINARY
        return MATCHED if isinstance(event, ProcessExit) else ORDINARY


class Delivery:
    """The spool -> Kafka path of one exporter."""

    def __init__(
        self,
        kafka: KafkaConfig,
        spool: Spool,
        cfg: DeliveryConfig | None = None,
        metrics: ExporterMetrics | None = None,
        priority: SpoolPriority | None = None,
    ) -> None:
        self.kafka = kafka
        self.spool = spool
        self.priority = priority or SpoolPriority()
        self.cfg = cfg or DeliveryConfig()
        self.metrics = metrics or ExporterMetrics()
        self.metrics.watch_spool(lambda: spool.pending_records, lambda: spool.pending_bytes)
        spool.on_drop = lambda n: self.metrics.drop("spool_full", n)
        self.metrics.watch_connection(lambda: self.connected)
        self._producer: EventProducer | None = None
        self._stop = threading.Event()
        self._drain_deadline = float("inf")
        self._thread: threading.Thread | None = None
        self.delivered = 0
        self.send_errors = 0
        self.last_ack_ms = 0
        self.last_error = ""
        self.connected = False

    # -- producer side (sampling threads) ------------------------------------------------------
    def publish(self, event: Event) -> None:
        topic = topic_for(event)
        self.spool.append(Record(topic.name, topic.key_of(event), encode(event)), self.priority(event))
        self.metrics.spooled.inc()

    def health(self) -> SourceHealth:
        """Delivery as a pseudo-source in the heartbeat: drops and send errors are its errors."""
        return SourceHealth(
            name="delivery",
            ok=self.connected and not self.last_error,
            last_success_ms=self.last_ack_ms,
            error_count=self.send_errors + self.spool.dropped_records,
            last_error=(
                f"{self.last_error} (spool: {self.spool.pending_records} pending, "
                f"{self.spool.dropped_records} dropped)"
            )[:4096]
            if self.last_error or self.spool.dropped_records
            else "",
        )

    # -- delivery thread -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="delivery", daemon=True)
        self._thread.start()

    def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Deliver what is spooled for up to ``drain_timeout_s``; the rest stays on disk."""
        self._drain_deadline = time.monotonic() + drain_timeout_s
        self._stop.set()
        if self._thread is not None:
            self._thread.join(drain_timeout_s + FLUSH_WAIT_S + 15)
        if self._producer is not None:
            try:
                self._producer.close(timeout_s=1.0)
            except Exception as exc:
                log.debug("closing producer: %s", exc)
        self.spool.close()

    def _give_up(self) -> bool:
        return self._stop.is_set() and time.monotonic() >= self._drain_deadline

    def _connect(self) -> EventProducer | None:
        if self._producer is None:
            # kafka-python insists on delivery_timeout_ms >= linger_ms + request_timeout_ms.
            request_timeout = min(
                self.kafka.request_timeout_ms, self.cfg.delivery_timeout_ms - self.cfg.linger_ms - 1
            )
            kafka = dataclasses.replace(self.kafka, request_timeout_ms=max(100, request_timeout))
            try:
                self._producer = EventProducer(
                    kafka,
                    linger_ms=self.cfg.linger_ms,
                    extra={
                        "delivery_timeout_ms": self.cfg.delivery_timeout_ms,
                        # send() may wait for metadata; only this thread ever waits on it.
                        "max_block_ms": 5000,
                        "reconnect_backoff_max_ms": 2000,
                    },
                )
            except BusError as exc:
                self._error(exc)
                return None
        return self._producer

    def _error(self, exc: BaseException | str) -> None:
        text = str(exc)
        if text != self.last_error:
            log.warning("delivery: %s", text)
        self.last_error = text
        self.connected = False

    def _run(self) -> None:
        # One backoff for connecting and delivering: only a delivered segment resets it.
        backoff = Backoff(initial_s=INITIAL_BACKOFF_S, max_s=MAX_BACKOFF_S)
        while not self._give_up():
            producer = self._connect()
            if producer is None:
                self._stop.wait(backoff.next_delay())
                continue
            self.spool.seal()
            path = self.spool.oldest()
            if path is None:
                if self._stop.is_set():
                    return  # drained
                self._stop.wait(IDLE_WAIT_S)
                continue
            if self._deliver(producer, path):
                backoff.reset()
            else:
                self._stop.wait(backoff.next_delay())

    def _reset(self) -> None:
        """Drop the producer: after an expired batch an idempotent kafka-python producer can stay
        wedged (seen here against Kafka 4.1), so the next round starts a fresh one."""
        if self._producer is not None:
            try:
                self._producer.close(timeout_s=0.5)
            except Exception as exc:
                log.debug("closing producer: %s", exc)
            self._producer = None

    def _deliver(self, producer: EventProducer, path: Path) -> bool:
        """Send one segment until every record is acknowledged (True), or give up for now (False):
        on a failed send (the unacknowledged rest is kept, the producer reset) or when stopping."""
        recs = self.spool.read(path)
        futures: dict[int, Any] = {}
        acked: set[int] = set()
        last_progress = time.monotonic()
        stuck_after_s = self.cfg.delivery_timeout_ms / 1000 + 5
        while True:
            for i, rec in enumerate(recs):
                if i in acked or i in futures:
                    continue
                try:
                    futures[i] = producer.send_raw(rec.topic, rec.value, key=rec.key)
                except Exception as exc:  # metadata timeout (broker away), buffer full
                    self._error(exc)
                    break
            # A flush timeout only means not everything is acknowledged yet: see the futures below.
            with contextlib.suppress(BusError):
                producer.flush(timeout_s=FLUSH_WAIT_S)
            failed = None
            for i, fut in futures.items():
                if i in acked or not fut.is_done:
                    continue
                if fut.succeeded():
                    acked.add(i)
                    self.delivered += 1
                    self.metrics.published.labels(recs[i].topic).inc()
                    self.last_ack_ms = now_ms()
                    last_progress = time.monotonic()
                else:
                    failed = fut.exception
            if len(acked) == len(recs):
                self.spool.remove(path)
                self.connected, self.last_error = True, ""
                return True
            stuck = time.monotonic() - last_progress > stuck_after_s
            if failed is not None or stuck or self._give_up() or len(futures) < len(recs):
                if failed is not None or stuck:
                    self.send_errors += 1
                    self.metrics.delivery_errors.inc()
                    self._error(failed if failed is not None else "no acknowledgement: producer stuck")
                    self._reset()
                self.spool.rewrite(path, [r for i, r in enumerate(recs) if i not in acked])
                return False
