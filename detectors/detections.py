"""Turning detector verdicts (:class:`~trainguard.detectors.findings.Finding`) into wire ``Detection`` events.

The detection id is derived from what was detected and the *event time* of the input that
triggered it, never from wall-clock processing time, so reprocessing the same input (a worker
restart, a rebalance, a replay) yields the same id and the store keeps one row.
"""

from __future__ import annotations

from typing import Any

from trainguard.detectors.findings import Finding
from trainguard.schemas.control import Detection, stable_id


def detection_from_finding(
    finding: Finding,
    *,
    job: str,
    source_ts_ms: int,
    now_ms: int,
    node: str = "",
    source_key: Any = "",
    message: str = "",
) -> Detection:
    """A Detection for ``finding``; ``source_key`` disambiguates several inputs at one instant."""
    evidence = finding.to_dict()["evidence"]
    rule = evidence.get("rule", "")
    node = node or finding.node or ""
    det_id = stable_id("det", finding.kind, rule, job, node, sorted(finding.ranks), source_ts_ms, source_key)
    score = finding.score if finding.score is not None and finding.score == finding.score else None
    return Detection(
        detection_id=det_id,
        ts_ms=now_ms,
        job=job,
        kind=str(rule or finding.kind),
        category=finding.category,
        severity=finding.severity,
        action=finding.action,
        node=node,
        ranks=sorted(int(r) for r in finding.ranks),
        score=score,
        message=message or _message(finding),
        evidence=evidence,
        source_ts_ms=source_ts_ms,
    )


def _message(f: Finding) -> str:
    where = f" on {f.node}" if f.node else ""
    ranks = f" ranks {list(f.ranks)}" if f.ranks else ""
    line = f.evidence.get("line")
    tail = f": {line[:200]}" if isinstance(line, str) and line else ""
    return f"{f.category} ({f.kind}){where}{ranks}{tail}"
