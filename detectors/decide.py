"""Detections -> decisions: what to do about a job, with a deterministic id, de-duplicated.

The mapping follows ByteRobust's automated fault-tolerance flow (§4, Fig. 5):

* ``evict``     -- machine-specific explicit faults (the detection's node), or the parallel group
                   chosen by the over-eviction analysis (``evidence["evict"]``);
* ``rollback``  -- user-code errors: roll back the latest code change, in place;
* ``restart``   -- transient faults: restart in place;
* ``diagnose``  -- a crash or NaN without a culprit: suspend and run stop-time diagnostics;
* ``aggregate`` -- hang / fail-slow suspicion: capture every rank's stacks and analyse them.

``ignore``/``none`` detections are recorded but decide nothing.  The same fault reported again
within ``dedup_window_s`` (every rank seeing the same NCCL error, a NIC that stays down) yields
no new decision.  The id hashes (job, action, targets, the dedup bucket of the *event time*), so
reprocessing the same detections after a restart reproduces the same ids and the action service,
idempotent by id, acts once.

>>> from trainguard.schemas.control import Detection
>>> from trainguard.schemas.enums import Action
>>> p = DecisionPolicy()
>>> d = Detection(detection_id="a", ts_ms=5, job="j", kind="xid-79", category="gpu_unavailable",
...               action=Action.EVICT, node="n3", source_ts_ms=1_000)
>>> dec = p.decide(d, now_ms=6)
>>> dec.action.value, dec.targets.machines, dec.targets.group_kind
('evict', ['n3'], 'machine')
>>> p.decide(d, now_ms=7) is None  # the same fault again: de-duplicated
True
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from trainguard.schemas.control import Decision, Detection, Targets, decision_id
from trainguard.schemas.enums import Action
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.typecheck import bounds

#: actions that never become decisions.
_RECORD_ONLY = (Action.NONE, Action.IGNORE)


@dataclass(frozen=True)
class DecideConfig:
    """Settings of :class:`DecisionPolicy`."""

    #: repeats of the same (job, action, targets) within this window decide nothing new.
    dedup_window_s: float = field(default=300.0, metadata=bounds(0, 86_400))
    #: memory bound on remembered decisions (oldest forgotten first).
    max_remembered: int = field(default=100_000, metadata=bounds(1, 10_000_000))


class DecisionPolicy:
    """Stateful (for de-duplication) mapping of detections to decisions."""

    def __init__(self, config: DecideConfig | None = None) -> None:
        self.config = config or DecideConfig()
        self._last: OrderedDict[tuple[Any, ...], int] = OrderedDict()
        self.suppressed = 0
        #: jobs whose dedup entries changed since :meth:`take_touched`.
        self._touched: set[str] = set()

    def targets(self, d: Detection, topology: JobTopology | None = None) -> Targets:
        evict = d.evidence.get("evict") if isinstance(d.evidence, dict) else None
        if isinstance(evict, dict) and evict.get("ranks"):
            ranks = sorted(int(r) for r in evict["ranks"])
            machines = [str(m) for m in evict.get("machine_names") or []]
            if not machines and topology is not None:
                machines = [topology.machine_name(m) for m in topology.machines_of(ranks)]
            return Targets(
                machines=sorted(machines), ranks=ranks, group_kind=str(evict.get("kind") or "group")
            )
        if d.action is Action.EVICT:
            if d.node:
                return Targets(machines=[d.node], ranks=sorted(d.ranks), group_kind="machine")
            if d.ranks and topology is not None:
                machines = [topology.machine_name(m) for m in topology.machines_of(d.ranks)]
                return Targets(machines=machines, ranks=sorted(d.ranks), group_kind="machine")
        return Targets(machines=[d.node] if d.node else [], ranks=sorted(d.ranks), group_kind="job")

    def decide(self, d: Detection, now_ms: int, topology: JobTopology | None = None) -> Decision | None:
        if d.action in _RECORD_ONLY:
            if d.kind == "over_eviction" and d.category == "healthy" and d.evidence.get("stalled_since_ms"):
                # A hang's capture found the job stepping: that stall is over, and the next one is
                # a new fault, not a repeat to suppress (a false suspicion would otherwise mute a
                # real hang for the whole window).
                key = self._key(d.job, Action.AGGREGATE, Targets(), "job_hang")
                if self._last.pop(key, None) is not None:
                    self._touched.add(d.job)
            return None
        targets = self.targets(d, topology)
        if d.action is Action.EVICT and not targets.machines:
            return None  # nothing to evict: the detection stays on record for operators
        key = self._key(d.job, d.action, targets, d.category)
        window_ms = int(self.config.dedup_window_s * 1000)
        event_ms = d.source_ts_ms or d.ts_ms
        last = self._last.get(key)
        # abs(): reports of one fault arrive out of order (rank 0's exit after rank 3's).
        if last is not None and abs(event_ms - last) < window_ms:
            self.suppressed += 1
            return None
        self._remember(key, event_ms)
        # A capture request is named by its own event (a stall by its last step): a false hang
        # suspicion clears the window (above), and the real hang after it must not reuse its id
        # -- the capture and its commands are named after the decision.
        exact = not window_ms or d.action is Action.AGGREGATE
        bucket = event_ms if exact else event_ms - event_ms % window_ms
        return Decision(
            decision_id=decision_id(d.job, d.action, targets, bucket),
            ts_ms=now_ms,
            job=d.job,
            action=d.action,
            targets=targets,
            reason=d.message or f"{d.category} ({d.kind})",
            detection_ids=[d.detection_id],
            evidence={
                "detection": {
                    "kind": d.kind,
                    "category": d.category,
                    "severity": d.severity.value,
                    "node": d.node,
                    "ranks": list(d.ranks),
                    "source_ts_ms": d.source_ts_ms,
                    # a hang suspicion's capture is judged no earlier (two-phase detection), and
                    # the stall threshold tells the capture how long a stuck collective has waited.
                    **{k: d.evidence[k] for k in ("confirm_at_ms", "threshold_s") if k in d.evidence},
                },
                **({"analysis": d.evidence} if d.kind == "over_eviction" else {}),
            },
        )

    def remember(self, dec: Decision) -> None:
        """Take ``dec``, decided earlier (by this policy or another), as decided: repeats are suppressed.

        What a restarted or offline policy needs to continue where a live one left off.
        """
        det = dec.evidence.get("detection") if isinstance(dec.evidence, dict) else None
        det = det if isinstance(det, dict) else {}
        key = self._key(dec.job, dec.action, dec.targets, str(det.get("category", "")))
        self._remember(key, int(det.get("source_ts_ms") or dec.ts_ms))

    @staticmethod
    def _key(job: str, action: Action, targets: Targets, category: str) -> tuple[Any, ...]:
        # Evictions are per target; other actions act on the whole job, so one per job and fault
        # category suffices (every rank reporting the same NaN is one fault; a NaN after a CPU
        # overload is another).
        key_targets = (
            (tuple(targets.machines), tuple(targets.ranks)) if action is Action.EVICT else (category,)
        )
        return (job, action.value, key_targets)

    def take_touched(self) -> set[str]:
        """The jobs whose de-duplication entries changed since the last call."""
        out, self._touched = self._touched, set()
        return out

    def entries_of(self, job: str) -> list[tuple[tuple[Any, ...], int]]:
        """The de-duplication entries of ``job``: (key, event time of its last decision)."""
        return [(k, ms) for k, ms in self._last.items() if k[0] == job]

    def restore_entries(self, job: str, entries: list[tuple[tuple[Any, ...], int]]) -> None:
        """Replace ``job``'s entries with ``entries`` (from :meth:`entries_of`)."""
        for k, _ in self.entries_of(job):
            del self._last[k]
        for k, ms in entries:
            self._remember(tuple(k), int(ms))
        self._touched.discard(job)

    def _remember(self, key: tuple[Any, ...], event_ms: int) -> None:
        self._touched.add(str(key[0]))
        self._last[key] = max(event_ms, self._last.get(key) or 0)
        self._last.move_to_end(key)
        while len(self._last) > self.config.max_remembered:
            self._last.popitem(last=False)
