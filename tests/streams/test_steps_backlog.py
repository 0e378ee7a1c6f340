"""StepsBacklog: whether step records wait unread on this worker, from the consumer's high
watermark and the broker's end offsets.  Demo run 20261128-052330: the worker read the steps
30-70 s late while the fetch's high watermark said it was caught up, and it judged a stepping job
hung.  The consumer here is a stand-in with the three calls the class makes of Faust's."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from trainguard.streams.agents.training import StepsBacklog


@dataclass(frozen=True)
class _TP:
    topic: str
    partition: int


@dataclass
class _Consumer:
    fetched: dict[_TP, int]
    broker: dict[_TP, int]
    calls: list[tuple[_TP, ...]] = field(default_factory=list)

    def assignment(self) -> set[_TP]:
        return set(self.fetched)

    def highwater(self, tp: _TP) -> int:
        return self.fetched[tp]

    async def highwaters(self, *tps: _TP) -> dict[_TP, int]:
        self.calls.append(tps)
        return {tp: self.broker[tp] for tp in tps}


class _Ctx:
    def __init__(self, consumer: _Consumer) -> None:
        self.app: Any = type("App", (), {"consumer": consumer})()

    def topic_name(self, topic: Any) -> str:
        return "trainguard.training.steps"


STEPS0 = _TP("trainguard.training.steps", 0)
OTHER = _TP("trainguard.training.exits", 0)


def test_caught_up_with_the_fetch_but_behind_the_broker_is_a_backlog() -> None:
    consumer = _Consumer(fetched={STEPS0: 101, OTHER: 5}, broker={STEPS0: 160, OTHER: 5})
    backlog = StepsBacklog(_Ctx(consumer))  # type: ignore[arg-type]
    backlog.seen(0, 100)
    assert backlog() is False  # the fetch's watermark alone: caught up
    asyncio.run(backlog.refresh())
    assert consumer.calls == [(STEPS0,)]  # only the steps partitions are asked
    assert backlog() is True
    backlog.seen(0, 159)
    assert backlog() is False


def test_nothing_processed_yet_is_no_backlog_known() -> None:
    consumer = _Consumer(fetched={STEPS0: 10}, broker={STEPS0: 50})
    backlog = StepsBacklog(_Ctx(consumer))  # type: ignore[arg-type]
    asyncio.run(backlog.refresh())
    assert backlog() is False


def test_a_partition_that_moved_away_and_back_starts_afresh() -> None:
    consumer = _Consumer(fetched={STEPS0: 101}, broker={STEPS0: 101})
    backlog = StepsBacklog(_Ctx(consumer))  # type: ignore[arg-type]
    backlog.seen(0, 100)
    consumer.fetched = {OTHER: 5}  # steps partition 0 revoked
    asyncio.run(backlog.refresh())
    assert backlog.processed == {} and backlog.broker_end == {}
    consumer.fetched, consumer.broker = {STEPS0: 300}, {STEPS0: 300}  # back, moved on meanwhile
    asyncio.run(backlog.refresh())
    assert backlog() is False  # nothing processed since it came back: no backlog known
