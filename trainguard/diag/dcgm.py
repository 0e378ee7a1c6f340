"""``dcgm``: NVIDIA DCGM's own diagnostic, ``dcgmi diag -r LEVEL``, when DCGM is installed; its
result table parsed into one entry per DCGM test.

``dcgmi diag`` prints a table of ``| <test> | <result> |`` rows under category rows
(``|-----  Deployment  ----|``, ``+-----  Hardware  ----+``): a result is ``Pass``, ``Fail``,
``Warn`` or ``Skip``, optionally followed by ``- All`` or the GPUs it applies to (``- GPU: 0``,
``- GPUs: 0, 1``).  A row whose first cell is empty and whose second is another result continues
the test above it (other GPUs, another outcome); rows such as ``| Warning: GPU 0 | text |`` or
``| Info | text |`` carry its details.  The ``Metadata`` category holds key/value rows (DCGM
version, driver).  :func:`parse_dcgmi_diag` is pure; :func:`run` finds ``dcgmi`` on PATH.

Skipped when ``dcgmi`` is not installed, or when it is but cannot reach ``nv-hostengine`` (DCGM
installed, its daemon not running: a site's choice, not the node's fault).  A ``Fail`` fails the
test; a ``Warn`` too with ``fail_on_warn``.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from typing import Any

from trainguard.diag.base import DiagContext, DiagResult, Skipped, register
from trainguard.diag.config import DcgmConfig
from trainguard.diag.tools import run_tool

#: a result cell: the outcome and what it applies to.
_RESULT = re.compile(r"^(pass|fail|warn|skip)\b\s*(?:-\s*(.*))?$", re.IGNORECASE)
#: a category row: dashes, a name, dashes.
_CATEGORY = re.compile(r"^[|+]-+\s+([A-Za-z][A-Za-z /]*?)\s+-+[+|]")
#: the worst outcome first: a test's overall status is the worst of its rows.
SEVERITY = ("fail", "warn", "pass", "skip")
#: what dcgmi prints when nv-hostengine is not there to talk to.
_NO_HOSTENGINE = re.compile(
    r"unable to (establish a )?connect|host engine|hostengine|connection refused", re.IGNORECASE
)


@dataclass
class DcgmTest:
    """One DCGM test of the table."""

    name: str
    category: str
    #: "pass", "fail", "warn" or "skip": the worst of ``results``.
    status: str
    #: outcome -> what it applies to ("All", "GPU: 0", ...), in table order.
    results: list[tuple[str, str]] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "category": self.category,
            "status": self.status,
            "results": [{"status": s, "applies_to": a} for s, a in self.results],
            "details": list(self.details),
        }


@dataclass
class DcgmReport:
    metadata: dict[str, str] = field(default_factory=dict)
    tests: list[DcgmTest] = field(default_factory=list)


def _cells(line: str) -> list[str] | None:
    text = line.strip()
    if not text.startswith("|") or not text.endswith("|"):
        return None
    return [c.strip() for c in text[1:-1].split("|")]


def _worst(statuses: list[str]) -> str:
    return min(statuses, key=SEVERITY.index) if statuses else "skip"


def parse_dcgmi_diag(text: str) -> DcgmReport:
    """The tests (and metadata) of ``dcgmi diag``'s table output; lines outside it are ignored.

    >>> r = parse_dcgmi_diag('''
    ... |-----  Hardware  ----------+-----------------------------|
    ... | GPU Memory                | Fail - GPU: 1               |
    ... | Warning: GPU 1            | 2 DBE found                 |
    ... ''')
    >>> [(t.name, t.category, t.status, t.results, t.details) for t in r.tests]
    [('GPU Memory', 'Hardware', 'fail', [('fail', 'GPU: 1')], ['Warning: GPU 1: 2 DBE found'])]
    """
    report = DcgmReport()
    category = ""
    current: DcgmTest | None = None
    for line in text.splitlines():
        m = _CATEGORY.match(line.strip())
        if m:
            category, current = m.group(1).strip(), None
            continue
        cells = _cells(line)
        if cells is None or len(cells) < 2 or set("".join(cells)) <= set("-=+ "):
            continue
        name, value = cells[0], " ".join(c for c in cells[1:] if c)
        if name == "Diagnostic" and value == "Result":
            continue  # the header row
        res = _RESULT.match(value)
        if category.lower() == "metadata" and res is None:
            if name:
                report.metadata[name] = value
            continue
        if res is not None and name and not _is_detail(name):
            current = DcgmTest(name=name, category=category, status="skip")
            report.tests.append(current)
        if current is None:
            continue
        if res is not None and (not name or current.name == name):
            current.results.append((res.group(1).lower(), (res.group(2) or "").strip()))
            current.status = _worst([s for s, _ in current.results])
        elif name or value:
            # a detail row, or the wrapped continuation of the one above
            detail = f"{name}: {value}" if name and value else name or value
            if not name and current.details:
                current.details[-1] = f"{current.details[-1]} {value}"
            else:
                current.details.append(detail)
    return report


def _is_detail(name: str) -> bool:
    return re.match(r"^(warning|error|info)\b", name, re.IGNORECASE) is not None


@register("dcgm", "`dcgmi diag -r LEVEL` (NVIDIA DCGM) when installed, its table parsed")
def run(ctx: DiagContext, result: DiagResult) -> None:
    cfg: DcgmConfig = ctx.section("dcgm")
    result.thresholds = {"failing_statuses": ["fail", "warn"] if cfg.fail_on_warn else ["fail"]}
    env = ctx.environ
    binary = shutil.which(cfg.binary, path=env.get("PATH"))
    if binary is None:
        raise Skipped(f"{cfg.binary} not installed (not on PATH): DCGM's diagnostic not run")
    argv = [binary, "diag", "-r", str(cfg.run_level)]
    result.measured["command"] = argv
    ctx.progress(f"dcgm: {' '.join(argv)} (up to {cfg.timeout_s:g} s)")
    run_ = run_tool(argv, cfg.timeout_s, env)
    if run_.timed_out:
        result.fail(f"{' '.join(argv)} did not finish within {cfg.timeout_s:g} s (killed)")
        return
    output = run_.tail
    report = parse_dcgmi_diag(run_.stdout)
    result.measured.update(
        returncode=run_.returncode,
        metadata=report.metadata,
        tests=[t.to_json() for t in report.tests],
    )
    if not report.tests:
        if _NO_HOSTENGINE.search(output):
            raise Skipped(f"{cfg.binary} is installed but cannot reach nv-hostengine: {output}")
        result.fail(f"{' '.join(argv)} gave no results (exit {run_.returncode}): {output or 'no output'}")
        return
    failing = {"fail", "warn"} if cfg.fail_on_warn else {"fail"}
    for t in report.tests:
        if t.status in failing:
            where = "; ".join(a for s, a in t.results if s in failing and a)
            why = f": {'; '.join(t.details)[:1000]}" if t.details else ""
            result.fail(f"dcgm {t.category} / {t.name}: {t.status}{f' ({where})' if where else ''}{why}")
