"""The over-eviction verdict: frozen records with a stable ``to_dict()`` wire form.

``OverEvictionResult.to_dict()`` gives exactly::

    {"verdict": "healthy" | "hang" | "fail_slow",
     "suspect_ranks": [...],
     "evict": {"kind": "tp" | "dp" | "pp" | "machine" | None, "ranks": [...], "machines": [...],
               "why": "...", "not_evicted": {"kind": ..., "ranks": [...]} | None},
     "evidence": {...}}

with machines numbered ``rank // ranks_per_machine``; a healthy verdict evicts nothing.  ``why``
and ``not_evicted`` say when the parallel group around the suspects was too large a share of the
job to evict (:func:`trainguard.detectors.eviction.choose_eviction`): kind ``machine`` (the
suspects' machines), or nothing at all when the suspects are on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainguard.detectors.eviction import ParallelGroup
from trainguard.schemas.enums import Verdict


@dataclass(frozen=True)
class StackClass:
    """Ranks whose process (``main`` or a helper) showed the same stack."""

    process: str  # "main" | "dataloader" | "checkpoint" | "other"
    role: str
    ranks: tuple[int, ...]
    frames: tuple[str, ...]  # innermost first, truncated
    suspect: bool  # holds a suspect rank (a busy helper of a suspect, for helpers)
    busy: bool | None = None  # helpers only: doing a job (True) or parked waiting for one

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "process": self.process,
            "role": self.role,
            "count": len(self.ranks),
            "ranks": list(self.ranks),
            "suspect": self.suspect,
            "frames": list(self.frames),
        }
        if self.busy is not None:
            out["busy"] = self.busy
        return out


@dataclass(frozen=True)
class Vote:
    """Fail-slow: how many rounds flagged one group."""

    kind: str
    ranks: tuple[int, ...]
    rounds: int

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "ranks": list(self.ranks), "rounds": self.rounds}


@dataclass(frozen=True)
class Evidence:
    """Why the verdict was reached: the deciding round's stack classes, votes, missing ranks."""

    reason: str
    analysis: str  # "hang" | "fail_slow": which procedure ran
    rounds: int  # rounds analysed
    cause: str  # see RoundAnalysis.cause
    root_reach: float  # share of ranks waiting on the suspects in the deciding round
    missing_ranks: tuple[int, ...]  # ranks with no main-process dump in the deciding round
    classes: tuple[StackClass, ...] = ()
    votes: tuple[Vote, ...] = ()
    #: fail-slow: the vote's chance p-value (None: no vote, e.g. a hang or no root in any round).
    p_value: float | None = None
    #: fail-slow: the ranks the signal that asked for the capture named (a straggler detection).
    hint: tuple[int, ...] = ()
    #: fail-slow: the vote is close, capture this many more rounds before judging (0: judged).
    more_rounds: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "analysis": self.analysis,
            "rounds": self.rounds,
            "cause": self.cause,
            "root_reach": round(self.root_reach, 4),
            "missing_ranks": list(self.missing_ranks),
            "classes": [c.to_dict() for c in self.classes],
            "votes": [v.to_dict() for v in self.votes],
            "p_value": None if self.p_value is None else float(f"{self.p_value:.4g}"),
            "hint": list(self.hint),
            "more_rounds": self.more_rounds,
        }


@dataclass(frozen=True)
class OverEvictionResult:
    """Verdict, suspects, the parallel group (or machines) to evict, with evidence."""

    verdict: Verdict
    suspect_ranks: tuple[int, ...]
    evict_kind: str | None
    evict_ranks: tuple[int, ...]
    evict_machines: tuple[int, ...]
    evidence: Evidence
    #: why the group around the suspects was not evicted ("" when it is).
    evict_why: str = ""
    not_evicted: ParallelGroup | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict.value,
            "suspect_ranks": list(self.suspect_ranks),
            "evict": {
                "kind": self.evict_kind,
                "ranks": list(self.evict_ranks),
                "machines": list(self.evict_machines),
                "why": self.evict_why,
                "not_evicted": self.not_evicted.to_dict() if self.not_evicted else None,
            },
            "evidence": self.evidence.to_dict(),
        }
