"""Detections -> decisions: what to do about a job, with a deterministic id, one per incident.

The mapping follows ByteRobust's automated fault-tolerance flow (§4, Fig. 5):

* ``evict``     -- machine-specific explicit faults (the detection's node), or the parallel group
                   chosen by the over-eviction analysis (``evidence["evict"]``);
* ``rollback``  -- user-code errors: roll back the latest code change, in place;
* ``restart``   -- transient faults: restart in place;
* ``diagnose``  -- a crash or NaN without a culprit: suspend and run stop-time diagnostics;
* ``aggregate`` -- hang / fail-slow suspicion: capture every rank's stacks and analyse them.

``ignore``/``none`` detections are recorded but decide nothing.

**Incidents, not windows.**  The first report of a fault opens an *incident* (per job and action:
per target machines for an eviction, per fault category otherwise) and decides; repeats are
merged into it, deciding nothing new, only

* while the incident's recovery is at work -- until the action service reports that recovery's
  end (:meth:`DecisionPolicy.recovery_ended`, fed from the ``control.actions`` events every
  worker follows), and at most ``incident_max_s`` after the first report (an end never heard:
  no action service, a decision dead-lettered, an ``aggregate`` whose capture led nowhere);
* and, ended or not, within ``settle_s`` of the first report, so every rank reporting the same
  crash stays one decision.

A fault after that -- after a finished recovery -- is a new incident with a new decision.  An
eviction's incident outlives a recovery that evicted: its machines are out of the job, and what
their exporters keep reporting is not the job's fault.  An ``aggregate`` decision's own recovery
is the action service ignoring it: its incident ends with the recovery its capture led to (a
decision of the same category, or one the over-eviction analysis made), or with a capture that
found the job stepping.

The id hashes (job, action, targets, the first report's *event time* floored to ``settle_s``),
so reprocessing the same detections after a restart reproduces the same ids and the action
service, idempotent by id, acts once.  Two incidents of one key are at least ``settle_s`` apart
(the later one would have been merged otherwise), so their ids never collide.

>>> from trainguard.schemas.control import Detection
>>> from trainguard.schemas.enums import Action
>>> p = DecisionPolicy()
>>> d = Detection(detection_id="a", ts_ms=5, job="j", kind="xid-79", category="gpu_unavailable",
...               action=Action.EVICT, node="n3", source_ts_ms=1_000)
>>> dec = p.decide(d, now_ms=6)
>>> dec.action.value, dec.targets.machines, dec.targets.group_kind
('evict', ['n3'], 'machine')
>>> p.decide(d, now_ms=7) is None  # the same fault again while its recovery works: merged
True
>>> crash = Detection(detection_id="c", ts_ms=10_000, job="j", kind="python-exception",
...                   category="crash", action=Action.DIAGNOSE, node="n1", source_ts_ms=10_000)
>>> first = p.decide(crash, now_ms=10_001)
>>> p.recovery_ended("j", first.decision_id)
>>> again = replace(crash, detection_id="e", source_ts_ms=108_000)  # 98 s later: a new crash
>>> p.decide(again, now_ms=108_001).decision_id != first.decision_id
True
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

from trainguard.schemas.control import Decision, Detection, Targets, decision_id
from trainguard.schemas.enums import Action
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.typecheck import bounds

#: actions that never become decisions.
_RECORD_ONLY = (Action.NONE, Action.IGNORE)
#: detection kinds made by a stack capture's analysis: their recovery ends the capture's incident.
_FROM_CAPTURE = ("over_eviction", "aggregation_failed")


@dataclass(frozen=True)
class DecideConfig:
    """Settings of :class:`DecisionPolicy`."""

    #: reports within this long of an incident's first report (event time, either way) belong to
    #: it even when its recovery ended: every rank reporting one crash, a few seconds apart.
    settle_s: float = field(default=20.0, metadata=bounds(0, 3600))
    #: an incident whose recovery's end is never heard merges repeats at most this long after its
    #: first report (the action service away, the decision dead-lettered, a capture that found nothing).
    incident_max_s: float = field(default=300.0, metadata=bounds(0, 86_400))
    #: memory bound on remembered incidents (oldest forgotten first).
    max_remembered: int = field(default=100_000, metadata=bounds(1, 10_000_000))


@dataclass(frozen=True)
class Incident:
    """One open (or recently ended) incident of a job: what repeats are merged into."""

    #: event time of its first report (the one that decided).
    first_ms: int
    #: the decision its first report made ("" when restored from an older state document).
    decision_id: str = ""
    #: the fault category and detection kind of that report.
    category: str = ""
    kind: str = ""
    #: the action service reported the end of its recovery.
    ended: bool = False


#: one incident in a state document: (key, first_ms, decision_id, category, kind, ended); a
#: document written before incidents existed holds (key, last decision's event time) pairs.
Entry = tuple[Any, ...]


class DecisionPolicy:
    """Stateful (the open incidents) mapping of detections to decisions."""

    def __init__(self, config: DecideConfig | None = None) -> None:
        self.config = config or DecideConfig()
        self._incidents: OrderedDict[tuple[Any, ...], Incident] = OrderedDict()
        #: reports merged into an incident (no decision of their own).
        self.suppressed = 0
        #: jobs whose incidents changed since :meth:`take_touched`.
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

    def hang_cleared(self, job: str) -> None:
        """End ``job``'s open stall incident: the stall was not a hang (its capture found the
        job stepping or nothing to evict, or the job stepped before a deferred capture could
        start), so the next stall report is decided anew, not merged as a repeat."""
        key = self._key(job, Action.AGGREGATE, Targets(), "job_hang")
        if self._incidents.pop(key, None) is not None:
            self._touched.add(job)

    def decide(self, d: Detection, now_ms: int, topology: JobTopology | None = None) -> Decision | None:
        if d.action in _RECORD_ONLY:
            if d.kind == "over_eviction" and d.category == "healthy" and d.evidence.get("stalled_since_ms"):
                # A hang's capture found the job stepping, or found nothing to evict: either way
                # the next stall report is decided anew, not merged as a repeat (a false suspicion
                # would otherwise mute a real hang until the incident's limit).  Measured in demo
                # run 20261128-042559: a capture judged healthy 6 s into a checkpoint hang muted
                # the hang reported 3 s later; the job waited 60 s for gloo's timeout.
                self.hang_cleared(d.job)
            return None
        targets = self.targets(d, topology)
        if d.action is Action.EVICT and not targets.machines:
            return None  # nothing to evict: the detection stays on record for operators
        key = self._key(d.job, d.action, targets, d.category)
        event_ms = d.source_ts_ms or d.ts_ms
        if self._merges(self._incidents.get(key), event_ms):
            self.suppressed += 1
            return None
        settle_ms = int(self.config.settle_s * 1000)
        # A capture request is named by its own event (a stall by its last step): a false hang
        # suspicion clears its incident (above), and the real hang after it must not reuse its
        # id -- the capture and its commands are named after the decision.
        exact = not settle_ms or d.action is Action.AGGREGATE
        bucket = event_ms if exact else event_ms - event_ms % settle_ms
        dec = Decision(
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
        self._open(key, Incident(event_ms, dec.decision_id, d.category, d.kind))
        return dec

    def _merges(self, inc: Incident | None, event_ms: int) -> bool:
        """Whether a report at ``event_ms`` belongs to ``inc`` (see the module docstring)."""
        if inc is None:
            return False
        # abs(): reports of one fault arrive out of order (rank 0's exit after rank 3's).
        apart = abs(event_ms - inc.first_ms)
        if apart < self.config.settle_s * 1000:
            return True
        return not inc.ended and apart < self.config.incident_max_s * 1000

    def remember(self, dec: Decision) -> None:
        """Take ``dec``, decided earlier (by this policy or another), as an open incident: repeats
        are merged until its recovery ends.

        What a restarted or offline policy needs to continue where a live one left off.
        """
        det = dec.evidence.get("detection") if isinstance(dec.evidence, dict) else None
        det = det if isinstance(det, dict) else {}
        category = str(det.get("category", ""))
        key = self._key(dec.job, dec.action, dec.targets, category)
        first = int(det.get("source_ts_ms") or dec.ts_ms)
        known = self._incidents.get(key)
        if known is not None and known.first_ms >= first and not known.ended:
            return  # a later incident of the key is open already
        self._open(key, Incident(first, dec.decision_id, category, str(det.get("kind", ""))))

    def recovery_ended(self, job: str, decision_id: str, succeeded: bool = True) -> None:
        """The action service finished the recovery of ``decision_id`` (``succeeded``, or
        failed; a merged or ignored decision's recovery ends too): its incident is over.

        Its repeats within ``settle_s`` of the first report are still merged; later ones decide
        anew.  Two exceptions.  An eviction that went through took its machines out of the job:
        what they report later (their exporters run on) is not the job's fault, so its incident
        runs to ``incident_max_s``.  And an ``aggregate`` decision's own end (the action service
        ignores it) ends nothing: its incident ends with the recovery its capture led to -- a
        decision of the same category, or one a capture's analysis made."""
        found = next(
            ((k, i) for k, i in self._incidents.items() if k[0] == job and i.decision_id == decision_id),
            None,
        )
        if found is None or found[0][1] == Action.AGGREGATE.value:
            return
        key, ended = found
        if not ended.ended and not (succeeded and key[1] == Action.EVICT.value):
            self._incidents[key] = replace(ended, ended=True)
            self._touched.add(job)
        for k, inc in list(self._incidents.items()):
            if k[0] != job or k[1] != Action.AGGREGATE.value or inc.ended:
                continue
            if inc.category == ended.category or ended.kind in _FROM_CAPTURE:
                self._incidents[k] = replace(inc, ended=True)
                self._touched.add(job)

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
        """The jobs whose incidents changed since the last call."""
        out, self._touched = self._touched, set()
        return out

    def jobs(self) -> set[str]:
        """The jobs with an incident on record."""
        return {str(k[0]) for k in self._incidents}

    def entries_of(self, job: str) -> list[Entry]:
        """The incidents of ``job``, as state: (key, first_ms, decision_id, category, kind, ended)."""
        return [
            (k, i.first_ms, i.decision_id, i.category, i.kind, i.ended)
            for k, i in self._incidents.items()
            if k[0] == job
        ]

    def restore_entries(self, job: str, entries: list[Entry] | list[list[Any]]) -> None:
        """Replace ``job``'s incidents with ``entries`` (from :meth:`entries_of`; ValueError for
        an entry that is not one).  A (key, ms) pair of an older document is an open incident
        whose decision is not known: it ends at ``incident_max_s``."""
        parsed: list[tuple[tuple[Any, ...], Incident]] = []
        for e in entries:
            if not isinstance(e, list | tuple) or len(e) not in (2, 6) or not isinstance(e[0], list | tuple):
                raise ValueError(f"not an incident entry: {e!r}")
            key = _frozen(e[0])
            if len(e) == 2:
                parsed.append((key, Incident(int(e[1]))))
            else:
                parsed.append((key, Incident(int(e[1]), str(e[2]), str(e[3]), str(e[4]), bool(e[5]))))
        for k in [k for k in self._incidents if k[0] == job]:
            del self._incidents[k]
        for k, inc in parsed:
            self._open(k, inc)
        self._touched.discard(job)

    def _open(self, key: tuple[Any, ...], inc: Incident) -> None:
        self._touched.add(str(key[0]))
        self._incidents[key] = inc
        self._incidents.move_to_end(key)
        while len(self._incidents) > self.config.max_remembered:
            self._incidents.popitem(last=False)


def _frozen(v: Any) -> Any:
    """``v`` with every list a tuple (a key read back from plain JSON is hashable again)."""
    return tuple(_frozen(x) for x in v) if isinstance(v, list | tuple) else v
