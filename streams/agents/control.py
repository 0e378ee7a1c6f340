"""Runtime configuration of detectors through the control topic (no restart).

A ``set_threshold`` command carries ``{"path": "monitor.stall.stall_s", "value": 30}`` (and
optionally ``"app_id"`` to address one worker group; without it every worker applies it); the
new worker config is validated as a whole (unknown paths and out-of-range values are rejected
and logged) and pushed to the live detectors.  Every worker must apply every change, so this is
not a group-consumed agent: each worker reads the whole control topic itself, from the start, so
a worker started later folds in all earlier changes too.  A command that cannot be applied (an
unknown path, a value the config rejects, or one that makes the config or the detectors raise)
is dead-lettered at stage ``worker:control`` by the reader and the worker keeps its last good
config; the commands after it are applied as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from trainguard.infra.bus import RejectedRecord
from trainguard.schemas.codec import decode
from trainguard.schemas.config import ConfigError, load_config
from trainguard.schemas.control import Command, CommandKind
from trainguard.schemas.topics import CONTROL
from trainguard.schemas.typecheck import to_plain
from trainguard.streams.config import WorkerConfig
from trainguard.streams.context import WorkerContext

log = logging.getLogger(__name__)


class RejectedCommand(RejectedRecord):
    """A control command addressed to this worker that cannot be applied."""


def apply_change(cfg: WorkerConfig, path: str, value: Any) -> WorkerConfig:
    """``cfg`` with ``path`` (dotted) set to ``value``, fully re-validated."""
    data = to_plain(cfg)
    node = data
    parts = path.split(".")
    for p in parts[:-1]:
        if not isinstance(node.get(p), dict):
            raise ConfigError(f"unknown setting {path!r}")
        node = node[p]
    if parts[-1] not in node:
        raise ConfigError(f"unknown setting {path!r}")
    node[parts[-1]] = value
    return load_config(WorkerConfig, data)


def register(ctx: WorkerContext, on_change: Callable[[WorkerConfig], None]) -> None:
    def handle(raw: bytes | None) -> None:
        # Raising is the reader's business: garbage (DecodeError) is logged with its coordinates
        # and left to the sink, anything else dead-lettered at worker:control.
        cmd = decode(raw, expect=Command)
        if not isinstance(cmd, Command) or cmd.kind is not CommandKind.SET_THRESHOLD:
            return
        target = cmd.args.get("app_id")
        if target and target != ctx.cfg.app_id:
            return  # meant for another worker group
        try:
            new = apply_change(ctx.cfg, str(cmd.args.get("path", "")), cmd.args.get("value"))
        except ConfigError as exc:  # raised to the reader, which dead-letters it (logged there)
            raise RejectedCommand(f"rejected control command {cmd.command_id}: {exc}") from exc
        on_change(new)  # raising: dead-lettered by the reader, ctx.cfg keeps the last good config
        ctx.cfg = new
        log.info("applied %s = %r (command %s)", cmd.args.get("path"), cmd.args.get("value"), cmd.command_id)

    # Every change on every worker, from the start of the topic (re-applying them in order after a
    # reconnect ends at the same config); the broker away: thresholds keep their last values.
    ctx.follow(CONTROL, handle, "control")
