"""One verdict for a whole failure log: the earliest root cause, and what to do about it.

A failure prints many lines: the fault, then what it sets off (every rank's NCCL watchdog
timing out, peers' connections closing, the launcher's exit summary).  Judging the log by its
most severe line blames the echo as often as the fault.  :func:`log_verdict` reads the log in
order through the traceback-aware :class:`~trainguard.detectors.log_classifier.LogClassifier`
(a Python traceback is one unit, judged on its final exception with its frames) and picks:

1. the earliest *cause* -- a line of a row that is not ``secondary`` and recommends acting;
   -- or, when an alert of the same category that its row tolerated (below the row's threshold)
   came before it, that alert, at its row's full action (an NFS server not responding, then a
   task hung in NFS);
2. else an alert its row tolerated once (below the row's threshold: a NIC flap, an SXid) that
   the log's later consequences show mattered -- at the row's full action;
3. else the earliest ``secondary`` line (a hang with nothing behind it is still a hang);
4. else the earliest recorded-only line, else nothing.

Lines are ordered by their place in the log (one stream is in time order; merge several by
time before calling).  A hung task whose kernel call trace runs through a shared filesystem is
reported as that (``kernel_trace`` rows refine the hung-task line, at its place).  Where the job's
code or environment changed at a known point (``code_changed_line`` / ``code_changed_ts``), a
software failure at or after it is a rollback.

>>> v = log_verdict([
...     "[rank1]:[E ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation timeout: "
...     "WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600010 "
...     "milliseconds before timing out.",
...     "[rank3]: RuntimeError: CUDA error: uncorrectable ECC error encountered",
...     "[rank0]:[E ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout",
... ])
>>> v.to_json()["action"], v.rule, v.line_no, v.consequences
('evict', 'cuda-ecc', 2, 1)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from trainguard.detectors.log_classifier import Classification, ClassifierConfig, LogClassifier
from trainguard.detectors.rule_table import Rule, RuleTable, default_rule_table
from trainguard.schemas.enums import Action, Severity

#: categories a code or environment change explains (a failure at or after the change: rollback).
SOFTWARE_CATEGORIES = frozenset(
    {"crash", "user_code", "cuda_error", "nan_value", "gpu_oom", "cpu_oom", "nccl_error"}
)
#: what a verdict's ``role`` says of the chosen line.
ROLES = ("cause", "tolerated", "secondary", "recorded", "none")
_QUIET = (Action.NONE, Action.IGNORE)


@dataclass(frozen=True)
class LogVerdict:
    """The verdict for a whole log.  ``to_json`` is the ``classify-log --verdict --json`` record."""

    action: Action = Action.NONE
    category: str | None = None
    rule: str | None = None
    severity: Severity | None = None
    #: the line that names the cause (for a refined hung task: the call-trace frame).
    cause_line: str | None = None
    #: 1-based place in the log of the cause (for a refined hung task: the hung-task line).
    line_no: int | None = None
    #: how the line was chosen, one of :data:`ROLES`.
    role: str = "none"
    #: acting lines after the cause (its consequences, or causes that came later).
    consequences: int = 0
    #: the classification of the chosen line (with fields: exception, user_module, xid, ...).
    classification: Classification | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        """Exactly ``{action, category, rule, cause_line}``."""
        return {
            "action": self.action.value,
            "category": self.category,
            "rule": self.rule,
            "cause_line": self.cause_line,
        }


@dataclass
class _Event:
    line_no: int
    c: Classification
    rule: Rule


def log_verdict(
    lines: Iterable[str],
    *,
    table: RuleTable | None = None,
    config: ClassifierConfig | None = None,
    host: str | None = None,
    code_changed_line: int | None = None,
    code_changed_ts: float | None = None,
    from_node: bool | None = None,
) -> LogVerdict:
    """The verdict for ``lines`` (one log, in order); see the module docstring.

    ``from_node``: False when a training process wrote ``lines`` (its exit's traceback): the
    node's kernel and driver rows do not fire on them (``RuleTable.match_line``)."""
    tbl = table if table is not None else default_rule_table()
    clf = LogClassifier(tbl, config)
    events: list[_Event] = []
    openers: dict[str | None, int] = {}  # host -> index in events of the last trace_follows line
    for n, raw in enumerate(lines, start=1):
        c = clf.feed(raw.rstrip("\r\n"), host=host, from_node=from_node)
        if c.rule is None:
            continue
        rule = tbl.get(c.rule)
        if rule.context == "kernel_trace" and host in openers:
            # The frame names what the hung task waits on: it replaces the hung-task finding,
            # at the hung task's place in the log.
            opener = events[openers.pop(host)]
            opener.c, opener.rule = c, rule
            continue
        events.append(_Event(n, c, rule))
        if rule.trace_follows:
            openers[host] = len(events) - 1
    chosen, role = _choose(events)
    if chosen is None:
        return LogVerdict()
    c = chosen.c
    action, severity, notes = c.action, c.severity, []
    if role == "tolerated":
        action, severity, _ = chosen.rule.decide(chosen.rule.count)
        notes.append("tolerated alert followed by its consequences: the row's full action")
    if (
        _after_change(chosen, code_changed_line, code_changed_ts)
        and c.category in SOFTWARE_CATEGORIES
        and action not in _QUIET
        and action is not Action.ROLLBACK
    ):
        action = Action.ROLLBACK
        notes.append("a software failure at or after the code/environment change: rollback")
    later = sum(1 for e in events if e.line_no > chosen.line_no and e.c.action not in _QUIET)
    return LogVerdict(
        action=action,
        category=c.category,
        rule=c.rule,
        severity=severity,
        cause_line=c.line,
        line_no=chosen.line_no,
        role=role,
        consequences=later,
        classification=replace(c, action=action, severity=severity) if action is not c.action else c,
        notes=tuple(notes),
    )


def _choose(events: list[_Event]) -> tuple[_Event | None, str]:
    acting = [e for e in events if e.c.action not in _QUIET]
    causes = [e for e in acting if not e.rule.secondary]
    if causes:
        # A tolerated alert of the same category just before the cause started it (an NFS
        # server not responding, then a task hung in NFS): the earliest line of the fault wins.
        first = causes[0]
        earlier = [
            e
            for e in events
            if _tolerated(e) and e.line_no < first.line_no and e.c.category == first.c.category
        ]
        if earlier:
            return earlier[0], "tolerated"
        return first, "cause"
    secondary = [e for e in acting if e.rule.secondary]
    if secondary:
        last = secondary[-1].line_no
        tolerated = [e for e in events if _tolerated(e) and e.line_no < last]
        if tolerated:
            return tolerated[0], "tolerated"
        return secondary[0], "secondary"
    recorded = [e for e in events if e.c.action is Action.IGNORE]
    return (recorded[0], "recorded") if recorded else (None, "none")


def _tolerated(e: _Event) -> bool:
    """An alert below its row's threshold, of a row that acts once the threshold is reached."""
    return (
        e.c.action is Action.IGNORE
        and e.rule.thresholded
        and not e.c.escalated
        and e.rule.action not in _QUIET
        and not e.rule.secondary
    )


def _after_change(e: _Event, line: int | None, ts: float | None) -> bool:
    if line is not None and e.line_no >= line:
        return True
    return ts is not None and e.c.ts is not None and e.c.ts >= ts
