"""The diag test protocol, its JSON result and the registry of tests by name.

A node test is one function ``run(ctx, result)`` in a file of its own, registered with
:func:`register` under the name users type (``trainguard diag --test gemm-digest``), like the
exporter's sources (node_exporter's ``registerCollector``).  Its config section in
:class:`~trainguard.diag.config.DiagConfig` has the same name with ``_`` for ``-``.

A test fills in the :class:`DiagResult` it is given -- what it measured, the thresholds it
checked against, and one finding per problem -- and raises :class:`Skipped` when it cannot run
here (no GPU, no driver, the tool not installed).  :func:`run_test` times it and turns an
exception into a failed result naming it, never a crash of the whole run: a CUDA error in the
middle of a matrix product is exactly what a node test is there to report.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainguard.diag.config import DiagConfig, section_name

log = logging.getLogger(__name__)

#: what an NVML call or a field the hardware does not have is recorded as (never a crash, never 0:
#: "not supported" must not look like "healthy").
NOT_SUPPORTED = "not supported"


class Skipped(Exception):
    """Raised by a test that cannot run on this node; the message is the reason users see."""


@dataclass
class DiagResult:
    """One test's outcome, printed as one JSON object (``trainguard diag --json``).

    ``passed``: true, false, or null when the test was skipped (``skipped_reason`` says why).
    ``findings``: one sentence per problem found, each naming the device; a test passed exactly
    when it ran and found none.  ``measured``: what it read or computed (per device where there
    are several); ``thresholds``: the limits it checked against (``null``: recorded, not checked).
    """

    test: str
    passed: bool | None = None
    skipped_reason: str | None = None
    measured: dict[str, Any] = field(default_factory=dict)
    thresholds: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0
    findings: list[str] = field(default_factory=list)

    def fail(self, finding: str) -> None:
        """Record one problem (the test then fails)."""
        self.findings.append(finding)

    def to_json(self) -> dict[str, Any]:
        """The result as a JSON object, keys in this fixed order."""
        return {
            "test": self.test,
            "passed": self.passed,
            "skipped_reason": self.skipped_reason,
            "measured": self.measured,
            "thresholds": self.thresholds,
            "duration_s": self.duration_s,
            "findings": list(self.findings),
        }


def _no_progress(message: str) -> None:
    """A context built outside the command (a test, a library caller) reports no progress."""


@dataclass
class DiagContext:
    """What a test gets: its settings and the few things tests replace (NVML, the environment)."""

    cfg: DiagConfig = field(default_factory=DiagConfig)
    #: an object with pynvml's function names to use instead of pynvml (tests, simulated GPUs).
    nvml: Any = None
    #: the environment external tools run in and are found on (``PATH``); None: ``os.environ``.
    env: Mapping[str, str] | None = None
    #: one line of progress for a human (stderr in the command).
    progress: Callable[[str], None] = _no_progress

    @property
    def environ(self) -> dict[str, str]:
        return dict(os.environ if self.env is None else self.env)

    def section(self, name: str) -> Any:
        """The config section of test ``name``."""
        return getattr(self.cfg, section_name(name))


TestFn = Callable[[DiagContext, DiagResult], None]


@dataclass(frozen=True)
class Registration:
    name: str
    fn: TestFn
    #: one line for ``trainguard diag --list``.
    summary: str


#: test name -> registration, in registration order.
REGISTRY: dict[str, Registration] = {}


def register(name: str, summary: str) -> Callable[[TestFn], TestFn]:
    """Decorator for a test function; ``name`` (with ``_`` for ``-``) is also its config section."""

    def deco(fn: TestFn) -> TestFn:
        if name in REGISTRY:
            raise ValueError(f"diag test {name!r} registered twice")
        if section_name(name) not in DiagConfig.__dataclass_fields__:
            raise ValueError(f"diag test {name!r} has no config section in DiagConfig")
        REGISTRY[name] = Registration(name, fn, summary)
        return fn

    return deco


def run_test(name: str, ctx: DiagContext) -> DiagResult:
    """Run one registered test: timed, skips and exceptions turned into its result."""
    reg = REGISTRY[name]
    result = DiagResult(test=name)
    started = time.monotonic()
    try:
        reg.fn(ctx, result)
    except Skipped as exc:
        result.skipped_reason = str(exc) or "skipped"
    except Exception as exc:  # a failing test is a result, not a crash of the whole run
        log.debug("diag test %s raised", name, exc_info=True)
        result.fail(f"the test itself failed: {type(exc).__name__}: {str(exc)[:2000]}")
    result.duration_s = round(time.monotonic() - started, 3)
    if result.skipped_reason is not None and not result.findings:
        result.passed = None
    else:
        # Findings recorded before a skip still fail the test: they were seen.
        result.skipped_reason = None
        result.passed = not result.findings
    return result
