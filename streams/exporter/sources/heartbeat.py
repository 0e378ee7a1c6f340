"""``heartbeat`` source: the exporter's own liveness and every source's health.

Each heartbeat carries, per source, whether its last round succeeded, when it last did, how many
rounds failed and how long the last one took (node_exporter's ``scrape_collector_success`` /
``_duration_seconds``), plus the delivery path (spool backlog and drops).  A missing heartbeat
is itself the signal that the exporter (or its node) is gone.  ``seq`` counts heartbeats since
the exporter started, so a consumer can count losses.
"""

from __future__ import annotations

import itertools

from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.telemetry import Heartbeat
from trainguard.streams.exporter.sources.base import SourceContext, register


class HeartbeatSource:
    name = "heartbeat"

    def __init__(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        self._seq = itertools.count()

    def collect(self) -> list[Event]:
        return [
            Heartbeat(
                node=self.ctx.node,
                component="exporter",
                ts_ms=now_ms(),
                seq=next(self._seq),
                job=self.ctx.job,
                sources=self.ctx.health(),
            )
        ]

    def close(self) -> None:
        pass


@register("heartbeat")
def _factory(ctx: SourceContext) -> HeartbeatSource:
    return HeartbeatSource(ctx)
