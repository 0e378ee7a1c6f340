"""The detection path's state per stage and key, for a changelog: what survives a worker restart
or a partition moving to another worker.

Each stateful stage keeps its state per Kafka key of its input (so a key's state lives with the
partition that feeds it):

===========  =====  ===============================================================================
stage        key    state
===========  =====  ===============================================================================
inspection   node   rule count windows ("2 NIC flaps in 5 minutes"), GPU/NIC counter baselines
training     job    the job monitor: step progress per rank (stall, stopped job), loss/grad
                    history (spikes), MFU baseline, exits, what was already reported
decide       job    the open incidents (a repeat while its recovery works decides nothing new)
aggregation  job    the capture cooldown and pending captures (their dumps are asked for again)
===========  =====  ===============================================================================

Not kept: the anomaly stage's learned per-node baselines (they re-learn within their warm-up)
and the straggler detector's step times (they re-fill within its window).

:meth:`PathState.take_dirty` says which keys changed, :meth:`PathState.snapshot` gives a key's
state as a document (:mod:`trainguard.detectors.state`), :meth:`PathState.restore` puts it back,
:meth:`PathState.drop` forgets a key.  Pure: the stream worker stores the documents in its
changelog (:mod:`trainguard.streams.state`); a test or a notebook can move state between two paths.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from trainguard.detectors import state as codec
from trainguard.detectors.capture import Capture
from trainguard.detectors.job_monitor import JobMonitor
from trainguard.detectors.routing import AGGREGATION, DECIDE, INSPECTION, TRAINING, DetectionPath
from trainguard.schemas.control import Command, CommandKind, stable_id

#: the stages whose state is kept, in :data:`trainguard.detectors.routing.INPUTS` order.
STATEFUL = (INSPECTION, TRAINING, DECIDE, AGGREGATION)
#: the parts of a job monitor that are kept.  Not the straggler detector's step-time window: for a
#: 10,000-rank job it is hundreds of thousands of samples, rewritten with every flush; it
#: re-fills within its window (``monitor.straggler.window_s``) after a move.
_MONITOR_PARTS = ("spike", "stall", "mfu", "stopped", "settle")


class PathState:
    """Snapshot/restore of a :class:`DetectionPath`'s per-key state (see the module docstring)."""

    def __init__(self, path: DetectionPath) -> None:
        self.path = path
        #: stage -> keys changed by the training timer / captures (the other stages track their own).
        self._dirty: dict[str, set[str]] = {s: set() for s in STATEFUL}

    def touch(self, stage: str, key: str) -> None:
        """Mark ``key`` of ``stage`` changed (what the caller knows changed it)."""
        self._dirty[stage].add(key)

    def take_dirty(self, stage: str) -> set[str]:
        """The keys of ``stage`` whose state changed since the last call."""
        out, self._dirty[stage] = self._dirty[stage], set()
        if stage == INSPECTION:
            out |= self.path.inspector.take_dirty()
        elif stage == DECIDE:
            out |= self.path.policy.take_touched()
        return out

    def keys(self, stage: str) -> set[str]:
        """The keys ``stage`` holds state for."""
        p = self.path
        if stage == INSPECTION:
            return p.inspector.nodes()
        if stage == TRAINING:
            return set(p.monitors)
        if stage == DECIDE:
            return p.policy.jobs()
        if stage == AGGREGATION:
            return set(p.captures.last_capture_ms) | {c.job for c in p.captures.pending.values()}
        raise ValueError(f"{stage!r} keeps no state")

    def snapshot(self, stage: str, key: str) -> str:
        """``key``'s state in ``stage`` as a document (an empty state is a document too)."""
        return codec.dump(self._state(stage, key))

    def _state(self, stage: str, key: str) -> Any:
        p = self.path
        if stage == INSPECTION:
            return p.inspector.node_state(key)
        if stage == TRAINING:
            m = p.monitors.get(key)
            if m is None:
                return None
            return {
                **{part: getattr(m, part) for part in _MONITOR_PARTS},
                "node_of": m.node_of,
                "alive": m.alive,
                "hang_at": m._hang_reported_at_step,
                "suspect_at": m._suspect_reported_at_step,
                "last_step_ts_ms": m._last_step_ts_ms,
            }
        if stage == DECIDE:
            return p.policy.entries_of(key)
        if stage == AGGREGATION:
            pending = [_without_dumps(c) for c in p.captures.pending.values() if c.job == key]
            return {"last_capture_ms": p.captures.last_capture_ms.get(key), "pending": pending}
        raise ValueError(f"{stage!r} keeps no state")

    def restore(self, stage: str, key: str, doc: str | bytes, now_ms: int) -> list[Command]:
        """Put ``key``'s state back from ``doc``; :class:`trainguard.detectors.state.StateError` if it is
        not one.

        Returns what must be sent again: for a restored pending capture, a ``capture_stacks``
        command per machine (the dumps received before the restart are not in the state)."""
        data = codec.load(doc)
        p = self.path
        if stage == INSPECTION:
            _expect(data, dict)
            p.inspector.restore_node(key, data)
        elif stage == TRAINING:
            if data is None:
                p.monitors.pop(key, None)
                return []
            _expect(data, dict)
            m = JobMonitor(key, p.config.monitor)
            for part in _MONITOR_PARTS:
                if part == "settle" and part not in data:
                    continue  # a document written before the exit wait existed: a fresh one
                setattr(m, part, data[part])
            m.node_of, m.alive = dict(data["node_of"]), dict(data["alive"])
            m._hang_reported_at_step = data["hang_at"]
            m._suspect_reported_at_step = data.get("suspect_at")  # absent from older documents
            m._last_step_ts_ms = int(data["last_step_ts_ms"])
            p.monitors[key] = m
            p.reconfigure(p.config)  # the worker's current thresholds, not the stored ones
        elif stage == DECIDE:
            _expect(data, list)
            p.policy.restore_entries(key, data)
        elif stage == AGGREGATION:
            _expect(data, dict)
            return self._restore_captures(key, data, now_ms)
        else:
            raise ValueError(f"{stage!r} keeps no state")
        return []

    def _restore_captures(self, job: str, data: dict[str, Any], now_ms: int) -> list[Command]:
        caps = self.path.captures
        if data.get("last_capture_ms") is not None:
            caps.last_capture_ms[job] = int(data["last_capture_ms"])
        out: list[Command] = []
        for cap in data.get("pending", []):
            if not isinstance(cap, Capture) or cap.capture_id in caps.pending:
                continue
            cap.dumps, cap.fr = [], {}
            # Asked again from now: the old deadline counted from the first request.
            cap.deadline_ms = now_ms + (cap.deadline_ms - cap.requested_ms)
            caps.pending[cap.capture_id] = cap
            for cmd in caps.commands(cap):
                out.append(
                    Command(
                        command_id=stable_id(cmd.command_id, "resumed", str(now_ms)),
                        ts_ms=now_ms,
                        kind=CommandKind.CAPTURE_STACKS,
                        node=cmd.node,
                        job=cmd.job,
                        args=cmd.args,
                    )
                )
        return out

    def drop(self, stage: str, key: str) -> None:
        """Forget ``key``'s state in ``stage`` (its partition is another worker's now)."""
        p = self.path
        if stage == INSPECTION:
            p.inspector.drop_node(key)
        elif stage == TRAINING:
            p.monitors.pop(key, None)
        elif stage == DECIDE:
            p.policy.restore_entries(key, [])
        elif stage == AGGREGATION:
            p.captures.last_capture_ms.pop(key, None)
            for cid in [cid for cid, c in p.captures.pending.items() if c.job == key]:
                p.captures.drop(cid)
        else:
            raise ValueError(f"{stage!r} keeps no state")
        self._dirty[stage].discard(key)


def _without_dumps(cap: Capture) -> Capture:
    # Dumps (stacks and Flight Recorders) can be megabytes each; they are asked for again on
    # restore instead of stored -- all
    # of its rounds (extended_from 0), the first ones included.  The rest (the straggler hint, a
    # hang's stall time) is kept.
    return replace(cap, dumps=[], fr={}, extended_from=0)


def _expect(data: Any, kind: type) -> None:
    if not isinstance(data, kind):
        raise codec.StateError(f"expected a {kind.__name__} of state, got {type(data).__name__}")
