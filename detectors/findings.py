"""The one result record of the rule classifier and the training-signal detectors.

Every detector in this area answers with :class:`Finding`: what was seen (``kind``), in which
failure category (ByteRobust Table 1 vocabulary: ``cuda_error``, ``network_error``, ``job_hang``,
``mfu_decline``...), how bad it is, which recovery action it recommends and the evidence behind
it.  The stream workers and the action service consume findings without caring which detector
produced them.

>>> f = Finding(kind="nan", category="nan_value", severity=Severity.ERROR, action=Action.DIAGNOSE,
...             job="j1", ranks=(3,), evidence={"metric": "loss"}, ts=12.0)
>>> f.to_dict()["action"], f.ranks
('diagnose', (3,))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainguard.schemas.enums import Action, Severity
from trainguard.schemas.typecheck import to_plain

#: ordering used to pick the worst of several findings or classifications.
SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.ERROR: 2, Severity.CRITICAL: 3}


@dataclass(frozen=True)
class Finding:
    """One detector verdict.

    Parameters
    ----------
    kind
        What detected it: ``log_rule``, ``nvml_rule``, ``nic_rule``, ``exit_rule``, ``nan``,
        ``spike``, ``hang``, ``straggler``, ``mfu_decline``.
    category
        Failure category (rule-table vocabulary), e.g. ``gpu_unavailable``.
    severity, action
        How bad, and the recommended recovery action.
    job, ranks, node
        Where; any of them may be unknown.
    score
        Detector-specific strength (robust z-score, jump factor, count in window...).
    evidence
        JSON-ready details (matched rule, extracted fields, last step per rank...).
    ts
        Timestamp of the observation that produced the finding (caller's clock).
    """

    kind: str
    category: str
    severity: Severity
    action: Action
    job: str | None = None
    ranks: tuple[int, ...] = ()
    node: str | None = None
    score: float | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    ts: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready plain dict (enums as their values, tuples as lists)."""
        out: dict[str, Any] = to_plain(self)
        return out


def worst(findings: list[Finding]) -> Finding | None:
    """The most severe finding (first one wins ties), or None for an empty list.

    >>> a = Finding("nan", "nan_value", Severity.ERROR, Action.DIAGNOSE)
    >>> b = Finding("spike", "loss_spike", Severity.WARNING, Action.DIAGNOSE)
    >>> worst([b, a]).kind
    'nan'
    """
    best: Finding | None = None
    for f in findings:
        if best is None or SEVERITY_RANK[f.severity] > SEVERITY_RANK[best.severity]:
            best = f
    return best
