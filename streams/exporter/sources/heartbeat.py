"""``heartbeat`` source: the exporter's own liveness and every source's health.

Each heartbeat carries, per source, whether its last round succeeded, when it last did, how many
rounds failed and how long the last one took (node_exporter's ``scrape_collector_success`` /
``_duration_seconds``), plus the delivery path (spool backlog and drops).  A missing heartbeat
is itself the signal that the exporter (or its node) is gone.  ``seq`` counts heartbeats since
the exporter started, so a consumer can count losses.  It also says which interfaces the ``nic``
source watches and which it skipped, with why (at most ``nic.max_listed`` of each, with totals):
what a NIC-down fault of this node can come from.
"""

from __future__ import annotations

import itertools

from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.telemetry import Heartbeat, SkippedNic
from trainguard.streams.exporter.sources.base import SourceContext, register


class HeartbeatSource:
    name = "heartbeat"

    def __init__(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        self._seq = itertools.count()

    def collect(self) -> list[Event]:
        nics = self.ctx.watching.get("nic")
        most = self.ctx.cfg.nic.max_listed
        return [
            Heartbeat(
                node=self.ctx.node,
                component="exporter",
                ts_ms=now_ms(),
                seq=next(self._seq),
                job=self.ctx.job,
                sources=self.ctx.health(),
                nics_watched=list(nics.watched[:most]) if nics else [],
                nics_watched_total=len(nics.watched) if nics else 0,
                nics_skipped=[SkippedNic(name, why) for name, why in nics.skipped[:most]] if nics else [],
                nics_skipped_total=len(nics.skipped) if nics else 0,
            )
        ]

    def close(self) -> None:
        pass


@register("heartbeat")
def _factory(ctx: SourceContext) -> HeartbeatSource:
    return HeartbeatSource(ctx)
