"""One over-eviction decision from two witnesses: the ranks' py-spy stacks and their Flight Recorders.

The stacks show what every process is doing (computing, loading data, checkpointing, waiting in
a collective); the Flight Recorder shows, per process group, which collectives each rank
entered and finished.  They fail differently -- the stacks cannot tell two ranks waiting in
different collectives apart, the recorder does not see point-to-point operations on gloo nor
what a rank outside any collective is doing -- so for a hang's capture:

* both name suspects and one's suspects lie in the other's group: that group (``both``; the
  stacks' group when each holds the other's suspects -- ByteRobust's unit);
* they disagree: the one group of the preferred kind holding both sets of suspects (``union``:
  over-evict rather than miss), else the stacks' verdict, the disagreement in the reason;
* only one names a group: its verdict (``stacks`` / ``flight_recorder``) -- the recorder alone
  only when its stuck collective waited ``alone_min_stuck_s`` (the full ``min_stuck_s``, not
  the shorter bar a fast job's capture uses to corroborate the stacks);
* a fail-slow verdict is the stacks' alone (every collective completes on a slow job);
* either witness names suspects but no group fit to evict (they are on every machine of the job,
  :func:`~trainguard.detectors.eviction.choose_eviction`) and the other names none: a hang that
  evicts nothing (the capture restarts the job in place instead);
* the stacks call a hang with ranks waiting in collectives, but every rank's recorder answered
  and shows none stuck for ``min_stuck_s``: not a hang (``healthy``, decided by the recorder).
  The stacks are one instant; the recorder says those waits began moments ago, so the job was
  slow, not stopped (a demo run under load evicted freshly swapped-in machines three times
  that way: a rank deep-copying its checkpoint while the others sat in their all-reduce).  A
  real hang still stalled at the next capture has its collective stuck by then.  Waits in
  point-to-point operations alone keep the stacks' verdict: gloo's recorder does not see them.

Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainguard.detectors.eviction import MACHINE, ParallelGroup, choose_eviction
from trainguard.detectors.flight_recorder.analysis import FlightRecorderResult
from trainguard.detectors.stacks.result import OverEvictionResult
from trainguard.schemas.enums import Verdict
from trainguard.schemas.topology import Dim, JobTopology


@dataclass(frozen=True)
class Combined:
    """The decision: what to evict and which witness decided it."""

    verdict: Verdict
    suspect_ranks: tuple[int, ...]
    evict_kind: str | None
    evict_ranks: tuple[int, ...]
    evict_machines: tuple[int, ...]
    #: stacks | flight_recorder | both | union
    decided_by: str
    reason: str
    #: why the group around the suspects was not evicted ("" when it is).
    evict_why: str = ""
    not_evicted: ParallelGroup | None = None


def _stacks(r: OverEvictionResult, why: str) -> Combined:
    return Combined(
        r.verdict, r.suspect_ranks, r.evict_kind, r.evict_ranks, r.evict_machines, "stacks", why,
        r.evict_why, r.not_evicted,
    )  # fmt: skip


def _in_collectives(r: OverEvictionResult) -> list[int]:
    """Ranks whose main process the stacks show inside a collective (which a recorder sees)."""
    return sorted(
        {
            rank
            for c in r.evidence.classes
            if c.process == "main" and c.role == "collective"
            for rank in c.ranks
        }
    )


def _unit(kind: str | None) -> str:
    """What an eviction of ``kind`` evicts, in words."""
    return "machines" if kind == MACHINE else f"{kind} group"


def _waits_for_more(waited: float, alone_min_stuck_s: float) -> str:
    return (
        f"the stacks name no group and the Flight Recorder's alone waits for more: its first "
        f"stuck collective waited {waited:.1f} s (< {alone_min_stuck_s:g} s)"
    )


def _evicts(r: OverEvictionResult) -> bool:
    return r.verdict is not Verdict.HEALTHY and bool(r.evict_ranks)


def combine(
    stacks: OverEvictionResult,
    fr: FlightRecorderResult | None,
    topology: JobTopology,
    preference: Sequence[Dim],
    alone_min_stuck_s: float = 0.0,
    max_group_share: float = 0.5,
) -> Combined:
    """The decision for one capture; ``fr`` None when no Flight Recorder dump could be read."""
    if fr is None:
        return _stacks(stacks, "no Flight Recorder dumps: the stacks decide")
    if stacks.verdict is Verdict.FAIL_SLOW:
        return _stacks(stacks, "fail-slow: the stacks decide (every collective completes on a slow job)")
    fr_evicts = fr.verdict != "healthy" and bool(fr.evict_ranks)
    waited = fr.stuck[0].waited_s if fr.stuck else float("inf")
    # The recorder alone decides only once its stuck collective waited the full bar.
    fr_alone = fr.verdict != "hang" or waited >= alone_min_stuck_s
    if not fr_evicts:
        why = f"the Flight Recorder shows no stuck collective ({fr.reason})"
        waiting = _in_collectives(stacks)
        if stacks.verdict is Verdict.HANG and fr.verdict == "healthy" and waiting and not fr.undumped_ranks:
            return Combined(
                Verdict.HEALTHY, (), None, (), (), "flight_recorder",
                f"not a hang: the stacks show ranks {waiting} in collectives, but every rank's Flight "
                f"Recorder shows none stuck ({fr.reason}): the job is slow, its collectives complete",
            )  # fmt: skip
        if fr.verdict != "healthy" and fr.suspect_ranks and stacks.verdict is Verdict.HEALTHY:
            # Stuck, but its suspects are on every machine: a hang that evicts nothing.
            if not fr_alone:
                return _stacks(stacks, _waits_for_more(waited, alone_min_stuck_s))
            return Combined(
                Verdict.HANG, fr.suspect_ranks, None, (), (), "flight_recorder",
                f"the stacks name no group; the Flight Recorder: {fr.reason}; {fr.evict_why}",
                fr.evict_why, fr.not_evicted,
            )  # fmt: skip
        if fr.verdict != "healthy":
            why = f"the Flight Recorder names no group to evict ({fr.reason})"
        return _stacks(stacks, why if _evicts(stacks) else f"neither witness names a group; {why}")
    fr_suspects = set(fr.suspect_ranks)
    if not _evicts(stacks):
        if not fr_alone:
            return _stacks(stacks, _waits_for_more(waited, alone_min_stuck_s))
        return Combined(
            Verdict.HANG,
            fr.suspect_ranks,
            fr.evict_kind,
            fr.evict_ranks,
            fr.evict_machines,
            "flight_recorder",
            f"the stacks name no group; the Flight Recorder: {fr.reason}",
            fr.evict_why,
            fr.not_evicted,
        )
    st_suspects = set(stacks.suspect_ranks)
    if fr_suspects <= set(stacks.evict_ranks):
        return Combined(
            stacks.verdict, stacks.suspect_ranks, stacks.evict_kind, stacks.evict_ranks,
            stacks.evict_machines, "both",
            f"the Flight Recorder's suspects {sorted(fr_suspects)} are in the stacks' "
            f"{_unit(stacks.evict_kind)}",
            stacks.evict_why, stacks.not_evicted,
        )  # fmt: skip
    if st_suspects <= set(fr.evict_ranks):
        return Combined(
            stacks.verdict, tuple(sorted(st_suspects | fr_suspects)), fr.evict_kind, fr.evict_ranks,
            fr.evict_machines, "both",
            f"the stacks' suspects {sorted(st_suspects)} are in the Flight Recorder's {_unit(fr.evict_kind)}",
            fr.evict_why, fr.not_evicted,
        )  # fmt: skip
    both = sorted(st_suspects | fr_suspects)
    ev = choose_eviction(topology, both, preference, max_group_share)
    if set(both) <= set(ev.ranks):
        return Combined(
            stacks.verdict, tuple(both), ev.kind, ev.ranks, ev.machines, "union",
            f"the witnesses disagree (stacks {sorted(st_suspects)}, Flight Recorder "
            f"{sorted(fr_suspects)}): the {_unit(ev.kind)} holding both",
            ev.why, ev.not_evicted,
        )  # fmt: skip
    return _stacks(
        stacks,
        f"the witnesses disagree and no one group holds both (stacks {sorted(st_suspects)}, "
        f"Flight Recorder {sorted(fr_suspects)}): the stacks decide",
    )
