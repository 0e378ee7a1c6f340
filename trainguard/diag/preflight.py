"""Preflight: what one run of node tests before a job means for the node, in the words a scheduler
shows, and the record of it.

A Slurm prolog (``infra/deploy/prolog.sh``) or a Kubernetes init container runs ``trainguard diag
--json --out FILE`` and hands the file and diag's exit status to ``trainguard preflight``; this
module judges them -- no I/O besides reading the file, so the judgement is the same wherever it
runs:

* :func:`judge` -- ``passed`` (every test passed or was skipped), ``failed`` (a test failed, or
  diag ran past its time limit: a node whose quick tests hang is not fit for a job), or ``error``
  (diag could not judge the node: not installed, a bad setting, a crash, unreadable output);
* :class:`PreflightPolicy` -- what to do about it: ``drain`` (take the node out: Slurm drain,
  Kubernetes cordon) or ``warn`` (record only), and whether an ``error`` takes the node out too
  (``on_error``: ``allow`` by default -- a broken TrainGuard install must not drain a cluster);
* :func:`reason_line` -- the one line the scheduler keeps with the node:
  ``trainguard preflight: <test>: <first finding>`` (Slurm's ``Reason=``, a Kubernetes annotation);
* :func:`node_check` -- the :class:`~trainguard.schemas.telemetry.NodeCheck` event that records it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.schemas.config import ConfigError
from trainguard.schemas.control import stable_id
from trainguard.schemas.telemetry import CheckAction, CheckOutcome, NodeCheck

#: what every reason starts with: how operators (and item 4's way back) tell TrainGuard's drains
#: from everyone else's.
REASON_PREFIX = "trainguard preflight"
#: Slurm keeps any length, but ``sinfo -R`` and the Kubernetes annotation are read by people:
#: one short line.
MAX_REASON_CHARS = 240
#: exit statuses of ``timeout(1)`` when it stopped the command (TERM, then KILL with ``-k``).
TIMEOUT_EXITS = (124, 137)
#: results files larger than this are not diag's (its quick level writes a few KiB).
MAX_RESULTS_BYTES = 4 * 1024 * 1024

POLICIES = ("drain", "warn")
ON_ERROR = ("allow", "drain")


@dataclass(frozen=True)
class PreflightPolicy:
    """What a preflight does about its verdict (``TRAINGUARD_PREFLIGHT_POLICY`` and
    ``TRAINGUARD_PREFLIGHT_ON_ERROR`` in the prolog; the same flags on ``trainguard preflight``).

    ``policy``: ``drain`` -- a failed node is drained (Slurm) or cordoned (Kubernetes) and the
    preflight exits non-zero, so the scheduler starts the job elsewhere; ``warn`` -- the failure is
    recorded and the job starts on the node anyway.  ``on_error``: when diag could not judge the
    node, ``allow`` lets the job start (and records the error), ``drain`` treats it as a failure.

    >>> PreflightPolicy().action(CheckOutcome.FAILED), PreflightPolicy("warn").action(CheckOutcome.FAILED)
    ('drain', 'warn')
    >>> error = CheckOutcome.ERROR
    >>> PreflightPolicy().action(error), PreflightPolicy(on_error="drain").action(error)
    ('none', 'drain')
    >>> PreflightPolicy("drian")
    Traceback (most recent call last):
    trainguard.schemas.config.ConfigError: preflight policy 'drian': expected one of drain, warn
    """

    policy: str = "drain"
    on_error: str = "allow"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"preflight policy {self.policy!r}: expected one of {', '.join(POLICIES)}")
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"preflight on_error {self.on_error!r}: expected one of {', '.join(ON_ERROR)}")

    def action(self, outcome: CheckOutcome) -> str:
        """``drain`` (take the node out), ``warn`` (record a failure, keep the node) or ``none``."""
        bad = outcome is CheckOutcome.FAILED or (outcome is CheckOutcome.ERROR and self.on_error == "drain")
        if not bad:
            return "none"
        return "drain" if self.policy == "drain" else "warn"


@dataclass(frozen=True)
class Verdict:
    """What one diag run said: the outcome, the failed tests, the scheduler's line and each
    test's result by name."""

    outcome: CheckOutcome
    reason: str = ""
    failed_tests: tuple[str, ...] = ()
    results: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0


def read_results(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The result objects of a ``trainguard diag --json`` file, and what was wrong with it (an
    unreadable file, a line that is no result object: each one sentence)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_RESULTS_BYTES:
            return [], [f"{p}: {size} bytes, more than diag writes ({MAX_RESULTS_BYTES})"]
        text = p.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return [], [f"{p}: no results file (diag wrote nothing)"]
    except OSError as exc:
        return [], [f"{p}: {exc.strerror or exc}"]
    lines: list[dict[str, Any]] = []
    problems: list[str] = []
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError:
            problems.append(f"{p}:{n}: not JSON")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("test"), str) or "passed" not in obj:
            problems.append(f"{p}:{n}: not a diag result (no test and passed)")
            continue
        lines.append(obj)
    return lines, problems


def _one_line(text: str) -> str:
    """Control characters (a newline in a tool's output) become spaces; runs of spaces one."""
    cleaned = "".join(c if c.isprintable() else " " for c in text)
    return " ".join(cleaned.split())


def reason_line(detail: str, test: str = "") -> str:
    """The scheduler's line: ``trainguard preflight: <test>: <detail>``, one line, capped.

    >>> reason_line("cpu: digest 1f2e... differs\\nfrom the expected", "gemm-digest")
    'trainguard preflight: gemm-digest: cpu: digest 1f2e... differs from the expected'
    >>> len(reason_line("x" * 1000, "memory"))
    240
    """
    line = _one_line(f"{REASON_PREFIX}: {test}: {detail}" if test else f"{REASON_PREFIX}: {detail}")
    if len(line) > MAX_REASON_CHARS:
        line = line[: MAX_REASON_CHARS - 3].rstrip() + "..."
    return line


def judge(
    lines: list[dict[str, Any]],
    diag_exit: int,
    problems: list[str] | None = None,
    timeout_s: float | None = None,
    diag_error: str = "",
) -> Verdict:
    """The verdict of one diag run from its result lines and exit status.

    A failed result fails the node whatever the exit status says (a run killed after a failure
    still found it).  ``diag_exit`` 124/137 with ``timeout_s`` is a run that hung: failed.  An exit
    status diag does not give for a clean run (2: bad invocation, 127: not installed, a signal),
    an exit 1 without a failed result, or unreadable lines are an ``error``; ``diag_error`` (the
    tail of diag's stderr) says why.

    >>> ok = {"test": "gemm-digest", "passed": True, "findings": [], "duration_s": 2.0}
    >>> judge([ok], 0).outcome
    <CheckOutcome.PASSED: 'passed'>
    >>> bad = {"test": "gemm-digest", "passed": False, "findings": ["cpu: digest differs", "x"]}
    >>> v = judge([ok | {"test": "gpu-health"}, bad], 1)
    >>> v.outcome.value, v.failed_tests, v.reason
    ('failed', ('gemm-digest',), 'trainguard preflight: gemm-digest: cpu: digest differs (+1 more)')
    >>> judge([ok], 124, timeout_s=90).reason
    'trainguard preflight: timeout: diag did not finish in 90 s (results of gemm-digest only)'
    >>> judge([], 127, diag_error="trainguard: command not found").reason
    'trainguard preflight: error: diag exited 127: trainguard: command not found'
    """
    results = {str(line["test"]): line for line in lines}
    duration = round(sum(_seconds(line.get("duration_s")) for line in lines), 3)
    failed = [line for line in lines if line.get("passed") is False]
    if failed:
        first = failed[0]
        findings = [str(f) for f in first.get("findings") or []] or ["failed without a finding"]
        extra = len(findings) - 1 + sum(max(1, len(line.get("findings") or [])) for line in failed[1:])
        detail = findings[0] + (f" (+{extra} more)" if extra else "")
        return Verdict(
            CheckOutcome.FAILED,
            reason_line(detail, str(first["test"])),
            tuple(str(line["test"]) for line in failed),
            results,
            duration,
        )
    if diag_exit in TIMEOUT_EXITS and timeout_s is not None:
        done = ", ".join(results) or "none"
        detail = f"diag did not finish in {timeout_s:g} s (results of {done} only)"
        return Verdict(CheckOutcome.FAILED, reason_line(detail, "timeout"), ("timeout",), results, duration)
    why = ""
    if diag_exit != 0:
        why = f"diag exited {diag_exit}" + (
            " without a failed result" if diag_exit == 1 and not diag_error else ""
        )
        if diag_error:
            why += f": {diag_error}"
    elif problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        why = f"unreadable results: {problems[0]}{more}"
    elif not lines:
        why = "diag ran no test"
    if why:
        return Verdict(CheckOutcome.ERROR, reason_line(why, "error"), (), results, duration)
    return Verdict(CheckOutcome.PASSED, "", (), results, duration)


def _seconds(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and value >= 0 else 0.0


def node_check(
    verdict: Verdict,
    *,
    node: str,
    origin: str,
    ts_ms: int,
    action: CheckAction,
    policy: str,
    job: str = "",
    level: str = "quick",
) -> NodeCheck:
    """The event recording ``verdict`` and what was done (``action``) on ``node``; its id is a
    function of the node, origin, job and time, so a record sent twice is one row."""
    return NodeCheck(
        check_id=stable_id("node_check", node, origin, job, ts_ms),
        node=node,
        ts_ms=ts_ms,
        origin=origin,
        job=job,
        level=level,
        outcome=verdict.outcome,
        action=action,
        policy=policy,
        failed_tests=list(verdict.failed_tests),
        reason=verdict.reason,
        duration_s=min(verdict.duration_s, 1e7),
        results=verdict.results,
    )
