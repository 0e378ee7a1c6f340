"""The urgent-first consumer (trainguard.streams.priority): urgent partitions' buffered records are handed
over before bulk telemetry, without waiting on them, and a worker's app installs it for its own
topic namespace.  What it buys under load is measured by bench/stream_load.py (Xid -> decision)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

import pytest
from aiokafka.consumer.fetcher import Fetcher
from faust.types import TP

from trainguard.infra.config import Settings
from trainguard.schemas.topics import DECISIONS, GPU, HOST, LOGS, NIC, STEPS
from trainguard.streams.app import build_app
from trainguard.streams.config import WorkerConfig
from trainguard.streams.priority import BULK_TOPICS, PREFETCH_BACKOFF_S, UrgentFirstConsumer, tune_fetcher


class FakeFetcher:
    """Stands in for Faust's consumer thread: records buffered per partition, calls recorded."""

    def __init__(self, buffered: dict[TP, list[str]]) -> None:
        self.buffered = buffered
        self.calls: list[tuple[frozenset[TP], float]] = []

    async def getmany(self, active: Any, timeout: float) -> dict[TP, list[str]]:
        self.calls.append((frozenset(active), timeout))
        return {tp: recs for tp, recs in self.buffered.items() if tp in active and recs}


def consumer(buffered: dict[TP, list[str]]) -> tuple[UrgentFirstConsumer, FakeFetcher]:
    class Bench(UrgentFirstConsumer):
        bulk_topics = frozenset(BULK_TOPICS)

    c = Bench.__new__(Bench)  # only _getmany is exercised: no transport, no thread
    fetcher = FakeFetcher(buffered)
    c._thread = fetcher  # type: ignore[assignment]
    return c, fetcher


GPU0, STEPS0, LOGS0, DEC0 = TP(GPU.name, 0), TP(STEPS.name, 0), TP(LOGS.name, 0), TP(DECISIONS.name, 0)
ALL = {GPU0, STEPS0, LOGS0, DEC0}


def test_urgent_records_are_handed_over_alone_and_without_waiting() -> None:
    c, f = consumer({GPU0: ["g1", "g2"], STEPS0: ["s1"], LOGS0: ["xid"], DEC0: []})
    got = asyncio.run(c._getmany(ALL, 1.0))
    assert got == {LOGS0: ["xid"]}
    assert f.calls == [(frozenset({LOGS0, DEC0}), 0.0)]  # the bulk is not even asked for


def test_with_nothing_urgent_buffered_every_partition_is_fetched_with_the_callers_timeout() -> None:
    c, f = consumer({GPU0: ["g1"], STEPS0: ["s1"], LOGS0: []})
    got = asyncio.run(c._getmany(ALL, 1.0))
    assert got == {GPU0: ["g1"], STEPS0: ["s1"]}
    assert f.calls == [(frozenset({LOGS0, DEC0}), 0.0), (frozenset(ALL), 1.0)]


def test_a_flood_of_urgent_records_never_starves_the_telemetry() -> None:
    c, _ = consumer({GPU0: ["g1"], LOGS0: ["line"] * 3})  # the fake never runs dry: a flood
    rounds = [asyncio.run(c._getmany(ALL, 1.0)) for _ in range(4)]
    assert [sorted(tp.topic for tp in r) for r in rounds] == [
        [LOGS.name],
        sorted([GPU.name, LOGS.name]),  # every other round is a full one
        [LOGS.name],
        sorted([GPU.name, LOGS.name]),
    ]


@pytest.mark.parametrize(
    "active",
    [
        pytest.param({LOGS0, DEC0}, id="only-urgent"),  # one round, as Faust's own consumer would
        pytest.param({GPU0, STEPS0}, id="only-bulk"),
        pytest.param(set(), id="none-active"),
    ],
)
def test_one_plain_round_when_there_is_nothing_to_put_first(active: set[TP]) -> None:
    c, f = consumer({GPU0: ["g1"], LOGS0: ["xid"]})
    asyncio.run(c._getmany(active, 1.0))
    assert f.calls == [(frozenset(active), 1.0)]


def test_every_bulk_topic_is_node_or_step_telemetry() -> None:
    # A topic left out of the bulk is urgent: new topics are urgent unless said otherwise.
    assert set(BULK_TOPICS) == {GPU.name, HOST.name, NIC.name, STEPS.name}
    assert LOGS.name not in BULK_TOPICS


def test_a_worker_app_uses_it_for_its_own_namespace(stack_settings: Settings) -> None:
    w = build_app(stack_settings, WorkerConfig(app_id="prio-test", topic_namespace="shadow", web_port=0))
    cls = w.app.transport.Consumer
    assert issubclass(cls, UrgentFirstConsumer)
    assert cls.bulk_topics == {f"trainguard.shadow.{n.removeprefix('trainguard.')}" for n in BULK_TOPICS}
    assert w.app.conf.broker_max_poll_records == 100


def test_it_can_be_turned_off(stack_settings: Settings) -> None:
    cfg = WorkerConfig(app_id="prio-off", urgent_first=False, max_poll_records=0, web_port=0)
    w = build_app(stack_settings, cfg)
    assert not issubclass(w.app.transport.Consumer, UrgentFirstConsumer)
    assert w.app.conf.broker_max_poll_records is None


class FakeAiokafkaFetcher:
    _prefetch_backoff = 0.1  # aiokafka's default


def test_the_fetcher_of_the_running_consumer_gets_the_short_prefetch_backoff_once() -> None:
    c, f = consumer({LOGS0: ["xid"]})
    fetcher = FakeAiokafkaFetcher()
    f._consumer = type("AIOKafkaConsumer", (), {"_fetcher": fetcher})()  # type: ignore[attr-defined]
    asyncio.run(c._getmany(ALL, 1.0))
    assert fetcher._prefetch_backoff == PREFETCH_BACKOFF_S
    fetcher._prefetch_backoff = 0.1  # set again only for a new fetcher (a restarted consumer thread)
    asyncio.run(c._getmany(ALL, 1.0))
    assert fetcher._prefetch_backoff == 0.1


def test_a_fetcher_without_the_attribute_is_a_warning_not_a_crash(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="trainguard.streams.priority"):
        tune_fetcher(object())
    assert "_prefetch_backoff" in caplog.text


def test_the_pinned_aiokafka_still_has_the_prefetch_backoff() -> None:
    # An upgrade that drops it makes urgent records wait 0.1 s more: fail here, not in a bench.
    assert "prefetch_backoff" in inspect.signature(Fetcher.__init__).parameters
