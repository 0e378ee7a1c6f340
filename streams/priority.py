"""Urgent records first: the worker's Kafka consumer hands over what is buffered on the urgent
topics (log lines, exits, detections, decisions, stack dumps, job specs, control) before any
bulk telemetry, and bulk telemetry in bounded batches.

Why: a worker has one Faust consumer for every agent.  Faust's fetch loop asks the consumer for
everything buffered, then delivers it record by record at the agents' pace; a record fetched
meanwhile waits until that whole batch is delivered.  At 2,400 machines the GPU, host and step
samples of one 1 s tick are about 2,500 records, 0.5 s of the worker's CPU: an Xid line waited
behind them once to become a detection and once more for that detection to become a decision
(p99 1.0-1.6 s in ``bench/stream_load.py``).  Here each fetch round first takes the urgent
partitions' buffered records (without waiting), and only when there are none -- or when the
round before was urgent-only, so that a flood of urgent records cannot starve the telemetry -- a
batch of at most ``max_poll_records`` from every partition.  An urgent record thus waits at most
for one or two bounded batches to be delivered.  Kafka's own fetching is unchanged (aiokafka
keeps prefetching every partition), and so are offsets, commits, the assignment and the order
within a partition: this only orders, across partitions, what was fetched.

Installed per app (:func:`install`) by giving the app's transport a consumer class of ours;
nothing global is patched.  The hook is Faust's ``ThreadDelegateConsumer._getmany``, the one
place every fetch round of the aiokafka driver goes through.
"""

from __future__ import annotations

import logging
from typing import Any

from faust.transport.drivers import aiokafka as faust_aiokafka

from trainguard.schemas.topics import GPU, HOST, NIC, STEPS

#: the registry topics whose records may wait behind each other: node telemetry and step samples,
#: the bulk of what a worker reads.  Every other topic a worker reads is urgent.
BULK_TOPICS = (GPU.name, HOST.name, NIC.name, STEPS.name)
#: aiokafka sends no fetch to a broker while any partition of it holds fetched records younger
#: than its ``prefetch_backoff`` (0.1 s; its consumer does not expose it).  Rounds of at most
#: ``max_poll_records`` leave records buffered, so every urgent record fetched after a round
#: began waited those 0.1 s: half the Xid -> decision time at 2,400 machines (the detection's hop).
PREFETCH_BACKOFF_S = 0.005

log = logging.getLogger(__name__)


class UrgentFirstConsumer(faust_aiokafka.Consumer):
    """Faust's aiokafka consumer, with urgent partitions' records taken first in each round."""

    #: names of the topics (as this worker reads them) that are bulk; set by :func:`install`.
    bulk_topics: frozenset[str] = frozenset()
    #: the last round handed over urgent records only: the next one is a full round.
    _urgent_last: bool = False
    #: the aiokafka fetcher whose prefetch backoff was set (a new one after a restart of the thread).
    _tuned: Any = None

    async def _getmany(self, active_partitions: Any, timeout: float) -> Any:
        fetcher = getattr(getattr(self._thread, "_consumer", None), "_fetcher", None)
        if fetcher is not None and fetcher is not self._tuned:
            tune_fetcher(fetcher)
            self._tuned = fetcher
        if active_partitions and not self._urgent_last:
            urgent = {tp for tp in active_partitions if tp.topic not in self.bulk_topics}
            if urgent and len(urgent) < len(active_partitions):
                # Only what is already buffered: never wait here, the bulk may be waiting.
                records = await super()._getmany(urgent, 0.0)
                if records:
                    self._urgent_last = True
                    return records
        # A full round (urgent partitions included) after every urgent-only one: a flood on an
        # urgent topic (a job printing thousands of lines a second) gets at most every other
        # round, and never starves the telemetry.
        self._urgent_last = False
        return await super()._getmany(active_partitions, timeout)


def tune_fetcher(fetcher: Any) -> None:
    """Set an aiokafka ``Fetcher``'s prefetch backoff to :data:`PREFETCH_BACKOFF_S` (a warning,
    not a failure, if this aiokafka has no such attribute: the worker still works, just slower)."""
    if not hasattr(fetcher, "_prefetch_backoff"):
        log.warning("this aiokafka's fetcher has no _prefetch_backoff: urgent records may wait 0.1 s more")
        return
    fetcher._prefetch_backoff = PREFETCH_BACKOFF_S


def install(app: Any, bulk_topic_names: set[str]) -> None:
    """Make ``app`` (not started yet) use :class:`UrgentFirstConsumer` with ``bulk_topic_names``."""
    if app._consumer is not None:  # the consumer is made when the app starts
        raise RuntimeError("the urgent-first consumer must be installed before the app's consumer exists")
    transport = app.transport
    if not issubclass(transport.Consumer, faust_aiokafka.Consumer):
        name = type(transport).__name__
        raise RuntimeError(f"unexpected Faust transport {name}: urgent-first needs the aiokafka one")
    transport.Consumer = type(
        "UrgentFirstConsumer",
        (UrgentFirstConsumer,),
        {"bulk_topics": frozenset(bulk_topic_names), "__module__": __name__},
    )
