"""The explicit-fault rule table: YAML rows mapping a signal to category, severity and action.

Operators change detection by editing ``detectors/rules/*.yaml`` (or pointing the classifier at
another file), not code.  A row matches one of four kinds of input (``source``):

* ``log``  -- one text line: an NVIDIA Xid code (``xid:``) and/or regular expressions
  (``patterns:``, searched case-insensitively; named groups become extracted fields).  Xid
  codes no row names, and Xid lines "caused by previous Xid N" (the ``xid_chain`` row, judged
  by N), take their action from the Xid catalog (:mod:`~trainguard.detectors.xid_catalog`);
* ``nvml`` -- one GPU's NVML sample (a dict), see :func:`nvml_fields`;
* ``nic``  -- one network interface's state sample, see :func:`nic_fields`;
* ``exit`` -- a process exit code / signal.

Structured rows test fields with ``when:`` -- ``{field: {op: value}}`` (all must hold) or
``{any: [<when>, ...]}``; ops are ``eq ne gt ge lt le in not_in contains_any``.

A log row's ``context`` limits where it applies: ``traceback`` -- the final exception line of a
Python traceback; ``import`` -- that line when the traceback was raised while importing a module;
``kernel_trace`` -- a line of the kernel call trace after a row marked ``trace_follows`` (a hung
task).  ``secondary`` rows name lines that usually echo another fault (watchdog timeouts, a peer's
closed connection, a launcher's exit summary): a whole-log verdict prefers any other cause.

A row may carry a threshold (``count``, ``window_s``, ``dedup_s``, ``key``): below it the row
recommends ``below_action`` (default ``ignore``), from the ``count``-th occurrence within the
window on, ``action``.  Rows are tried in ``priority`` order (lower first, then file order); the
first match wins, except structured inputs, where every matching row is reported.

>>> table = default_rule_table()
>>> m = table.match_line("[ 1234.567890] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, "
...                      "GPU has fallen off the bus.")
>>> m.rule.id, m.rule.action.value, m.fields["xid"], m.fields["pci"]
('xid-79', 'evict', 79, '0000:3b:00')
>>> [m.rule.id for m in match_nvml({"state": "lost", "temperature_c": 40.0})]
['nvml-gpu-lost']
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from trainguard.detectors.xid_catalog import XidCatalog, default_xid_catalog
from trainguard.schemas.enums import Action, Severity
from trainguard.schemas.typecheck import SchemaError, bounds, from_mapping

RULES_DIR = Path(__file__).with_name("rules")
SOURCES = ("log", "nvml", "nic", "exit")
CONTEXTS = ("any", "traceback", "import", "kernel_trace")
#: log rows: who may have written a line the row matches.  ``node``: the machine itself (its
#: kernel, driver or firmware), so only a line the node exporter read from the node (a LogLine
#: whose source is in ``trainguard.schemas.workload.NODE_LOG_SOURCES``) may match it; ``any``: a
#: training process's output as well.  Xid rows are always ``node``: an Xid is the driver's report.
ORIGINS = ("any", "node")
_OPS = ("eq", "ne", "gt", "ge", "lt", "le", "in", "not_in", "contains_any")
#: actions a row may recommend; ``none`` is reserved for "no rule matched".
ROW_ACTIONS = (Action.EVICT, Action.RESTART, Action.ROLLBACK, Action.DIAGNOSE, Action.IGNORE)

# NVRM prints "Xid (PCI:0000:3b:00): 79, pid=..., name=..., <message>"; older drivers omit
# "PCI:", log shippers may drop "NVRM:" or change case, DCGM/k8s events say "XID 79" / "xid=79".
_XID_NVRM = re.compile(
    r"\bxid\s*\(\s*(?:pci:)?(?P<pci>[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}(?:\.[0-7])?|[^)]*?)\s*\)\s*:\s*"
    r"(?P<xid>\d{1,4})\b\s*,?(?P<rest>.*)$",
    re.IGNORECASE,
)
_XID_LOOSE = re.compile(
    r"\bxid(?:\s+error)?\s*(?:code)?\s*[:=#]?\s*(?P<xid>\d{1,4})\b(?P<rest>.*)$", re.IGNORECASE
)
_XID_PID = re.compile(r"\bpid\s*=\s*'?(?P<pid>\d+)'?", re.IGNORECASE)
_XID_NAME = re.compile(r"\bname\s*=\s*(?P<name>[^,]+?)\s*,", re.IGNORECASE)
# NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149
_XID_CAUSE = re.compile(r"\bcaused by (?:a )?previous xid\s*[:#]?\s*(?P<cause>\d{1,4})\b", re.IGNORECASE)


class RuleTableError(ValueError):
    """A rule file is unreadable or a row is invalid; the message names the file and row."""


@dataclass(frozen=True)
class Rule:
    """One row of the rule table (see the module docstring for the semantics)."""

    id: str
    category: str
    severity: Severity
    action: Action
    source: str = "log"
    description: str = ""
    #: log rows: regular expressions (case-insensitive ``re.search``); named groups -> fields.
    patterns: list[str] = field(default_factory=list)
    #: log rows: Xid codes this row covers (the line must be an Xid line with one of them).
    xid: list[int] = field(default_factory=list)
    #: log rows: the catch-all for Xid codes no other row covers (catalog codes: the catalog decides).
    xid_fallback: bool = False
    #: log rows: the row for Xid lines "caused by previous Xid N", judged by N through the catalog.
    xid_chain: bool = False
    #: log rows: where the row applies (``any``, ``traceback``, ``import``, ``kernel_trace``).
    context: str = "any"
    #: log rows: a kernel call trace follows the line (``kernel_trace`` rows look at its frames).
    trace_follows: bool = False
    #: log rows: ``node`` when only the node's own kernel/driver lines may match (see ``ORIGINS``):
    #: a rank printing "GPU has fallen off the bus" must not evict its machine, or another one.
    origin: str = "any"
    #: whole-log verdicts: the line usually echoes another fault; any other cause wins over it.
    secondary: bool = False
    #: structured rows: field conditions.
    when: dict[str, Any] = field(default_factory=dict)
    count: int = field(default=1, metadata=bounds(1, 1_000_000))
    window_s: float | None = field(default=None, metadata=bounds(0.001, 1e9))
    dedup_s: float = field(default=0.0, metadata=bounds(0.0, 1e9))
    #: extracted fields that separate counters (e.g. ``[pci]``: one count per GPU).
    key: list[str] = field(default_factory=list)
    below_action: Action | None = None
    below_severity: Severity | None = None
    priority: int = field(default=100, metadata=bounds(0, 1_000_000))
    #: real-looking inputs this row must match (a line, or a sample dict); tested per row.
    examples: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source {self.source!r} is not one of {', '.join(SOURCES)}")
        if self.context not in CONTEXTS:
            raise ValueError(f"context {self.context!r} is not one of {', '.join(CONTEXTS)}")
        if self.origin not in ORIGINS:
            raise ValueError(f"origin {self.origin!r} is not one of {', '.join(ORIGINS)}")
        if self.origin != "any" and self.source != "log":
            raise ValueError(f"origin applies to log rows, not {self.source} rows")
        for a in (self.action, self.below_action):
            if a is not None and a not in ROW_ACTIONS:
                raise ValueError(f"action {a.value!r} is not allowed in a rule row")
        if self.source == "log":
            if not (self.patterns or self.xid or self.xid_fallback or self.xid_chain):
                raise ValueError("a log row needs patterns, xid codes, xid_fallback or xid_chain")
            if self.context != "any" and not self.patterns:
                raise ValueError(f"a {self.context!r} row needs patterns")
            if self.when:
                raise ValueError("'when' applies to nvml/nic/exit rows, not log rows")
        else:
            if not self.when or self.patterns or self.xid or self.xid_fallback or self.xid_chain:
                raise ValueError(f"a {self.source} row needs 'when' (and no patterns/xid)")
            _check_when(self.when)
        if self.count > 1 and self.window_s is None:
            raise ValueError("count > 1 needs window_s")
        if (self.below_action or self.below_severity) and self.count <= 1:
            raise ValueError("below_action/below_severity need a threshold (count > 1)")
        for p in self.patterns:
            try:
                re.compile(p, re.IGNORECASE)
            except re.error as exc:
                raise ValueError(f"pattern {p!r} does not compile: {exc}") from None

    @property
    def thresholded(self) -> bool:
        return self.count > 1

    def decide(self, count: int) -> tuple[Action, Severity, bool]:
        """(action, severity, escalated) for the ``count``-th occurrence in the window.

        >>> r = Rule(id="x", category="network_error", severity=Severity.ERROR, action=Action.EVICT,
        ...          patterns=["link down"], count=2, window_s=300, below_action=Action.IGNORE,
        ...          below_severity=Severity.WARNING)
        >>> [(a.value, s.value, esc) for a, s, esc in (r.decide(1), r.decide(2))]
        [('ignore', 'warning', False), ('evict', 'error', True)]
        """
        if count >= self.count:
            return self.action, self.severity, self.thresholded
        return self.below_action or Action.IGNORE, self.below_severity or self.severity, False


@dataclass(frozen=True)
class RuleMatch:
    """A row that matched, with the fields extracted from the input.

    ``action``/``severity``/``category`` are set where the row defers to the Xid catalog (the
    code's own or, for a chain, its cause's entry); otherwise the row's own apply."""

    rule: Rule
    fields: dict[str, Any]
    action: Action | None = None
    severity: Severity | None = None
    category: str | None = None

    def decide(self, count: int) -> tuple[Action, Severity, bool]:
        """The row's :meth:`Rule.decide`, or the catalog's decision where it applies."""
        if self.action is not None and self.severity is not None:
            return self.action, self.severity, False
        return self.rule.decide(count)


def _check_when(when: Mapping[str, Any]) -> None:
    for name, cond in when.items():
        if name == "any":
            if not isinstance(cond, list) or not cond:
                raise ValueError("'any' needs a non-empty list of conditions")
            for sub in cond:
                if not isinstance(sub, dict):
                    raise ValueError("each 'any' entry must be a mapping")
                _check_when(sub)
            continue
        if not isinstance(cond, dict) or not cond:
            raise ValueError(f"condition for {name!r} must be a mapping like {{ge: 85}}")
        for op, arg in cond.items():
            if op not in _OPS:
                raise ValueError(f"unknown operator {op!r} for {name!r} (use {', '.join(_OPS)})")
            if op in ("in", "not_in", "contains_any") and not isinstance(arg, list):
                raise ValueError(f"operator {op!r} for {name!r} needs a list")


def _norm(v: Any) -> Any:
    return v.strip().lower() if isinstance(v, str) else v


def _test(value: Any, op: str, arg: Any) -> bool:
    """One condition; mismatched or missing values are simply "does not hold"."""
    if value is None:
        return False
    value, arg = _norm(value), [_norm(a) for a in arg] if isinstance(arg, list) else _norm(arg)
    try:
        if op == "eq":
            return bool(value == arg)
        if op == "ne":
            return bool(value != arg)
        if op == "in":
            return value in arg
        if op == "not_in":
            return value not in arg
        if op == "contains_any":
            items = {_norm(v) for v in value} if isinstance(value, list | tuple | set) else {value}
            return any(a in items for a in arg)
        if isinstance(value, bool) or not isinstance(value, int | float) or not isinstance(arg, int | float):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return {"gt": value > arg, "ge": value >= arg, "lt": value < arg, "le": value <= arg}[op]
    except TypeError:
        return False


def when_holds(when: Mapping[str, Any], fields: Mapping[str, Any]) -> bool:
    """True if every condition of ``when`` holds on ``fields`` (``any`` = at least one)."""
    for name, cond in when.items():
        if name == "any":
            if not any(when_holds(sub, fields) for sub in cond):
                return False
        elif not all(_test(fields.get(name), op, arg) for op, arg in cond.items()):
            return False
    return True


def parse_xid(line: str) -> dict[str, Any] | None:
    """Xid code, PCI bus, pid, process name and message of an NVRM Xid line, else None.

    >>> parse_xid("NVRM: Xid (PCI:0000:b1:00): 13, pid='<unknown>', name=<unknown>, Graphics SM "
    ...           "Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address")["xid"]
    13
    >>> parse_xid("NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by "
    ...           "previous Xid 149")["caused_by"]
    149
    >>> parse_xid("kernel: eth0: link up") is None
    True
    """
    m = _XID_NVRM.search(line) or _XID_LOOSE.search(line)
    if m is None:
        return None
    out: dict[str, Any] = {"xid": int(m.group("xid"))}
    pci = m.groupdict().get("pci")
    if pci:
        out["pci"] = pci.lower()
    rest = m.group("rest") or ""
    if pm := _XID_PID.search(rest):
        out["pid"] = int(pm.group("pid"))
    if nm := _XID_NAME.search(rest):
        out["process"] = nm.group("name").strip("'\"")
    if cm := _XID_CAUSE.search(rest):
        out["caused_by"] = int(cm.group("cause"))
    out["message"] = rest.strip(" ,")
    return out


def required_literals(pattern: str) -> list[frozenset[str]]:
    r"""Literal texts a match of ``pattern`` must contain: each clause is "any of these" (lowercase).

    Used as a cheap prefilter (substring tests) before running the regular expression; an
    unparseable pattern simply has no clauses (always searched).

    >>> [sorted(c) for c in required_literals(r"NETDEV WATCHDOG:\s*(?P<i>\w+) .*transmit (?:queue|ring)")]
    [['netdev watchdog:'], ['transmit '], ['queue', 'ring']]
    """
    try:
        from re import _parser as sre  # type: ignore[attr-defined]

        tree = sre.parse(pattern)
    except Exception:  # private API moved, or an exotic pattern: no prefilter, still correct
        return []
    return _literal_clauses(list(tree), sre)


def _literal_clauses(items: list[Any], sre: Any) -> list[frozenset[str]]:
    clauses: list[frozenset[str]] = []
    run: list[str] = []

    def flush() -> None:
        if len(run) >= 3:
            clauses.append(frozenset({"".join(run).lower()}))
        run.clear()

    for op, av in items:
        if op is sre.LITERAL:
            run.append(chr(av))
            continue
        flush()
        if op is sre.SUBPATTERN:
            clauses.extend(_literal_clauses(list(av[-1]), sre))
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT) and av[0] >= 1:
            clauses.extend(_literal_clauses(list(av[2]), sre))
        elif op is sre.BRANCH:
            # any-of: usable only if every alternative requires some literal
            alts = [_literal_clauses(list(b), sre) for b in av[1]]
            if all(alts):
                # per alternative its most selective clause; the branch needs one of their literals
                chosen = [max(a, key=lambda c: min(len(x) for x in c)) for a in alts]
                clauses.append(frozenset().union(*chosen))
    flush()
    return clauses


def _anchor(clauses: list[frozenset[str]]) -> tuple[str | None, frozenset[str] | None]:
    """The most selective single required literal, else one any-of clause, for the prefilter."""
    singles = [next(iter(c)) for c in clauses if len(c) == 1]
    if singles:
        return max(singles, key=len), None
    return None, (min(clauses, key=len) if clauses else None)


class RuleTable:
    """Validated, ordered rows with compiled patterns; matching is pure (no counting here)."""

    def __init__(
        self, rules: Sequence[Rule], *, prefilter: bool = True, xid_catalog: XidCatalog | None = None
    ) -> None:
        seen: set[str] = set()
        for r in rules:
            if r.id in seen:
                raise RuleTableError(f"duplicate rule id {r.id!r}")
            seen.add(r.id)
        order = sorted(range(len(rules)), key=lambda i: (rules[i].priority, i))
        self.rules: tuple[Rule, ...] = tuple(rules[i] for i in order)
        self._by_id = {r.id: r for r in self.rules}
        self._compiled = {r.id: [re.compile(p, re.IGNORECASE) for p in r.patterns] for r in self.rules}
        # Substring prefilters: most lines match no rule, and a regex scan per pattern per line
        # dominates the cost; literal checks reject them first (ASCII lines only, where
        # lower() agrees exactly with re.IGNORECASE).
        self._anchors = {
            r.id: [_anchor(required_literals(p)) if prefilter else (None, None) for p in r.patterns]
            for r in self.rules
        }
        self._xid_rows: dict[int, list[Rule]] = {}
        for r in self.rules:
            if r.source == "log":
                for code in r.xid:
                    self._xid_rows.setdefault(code, []).append(r)
        self._xid_fallback = next((r for r in self.rules if r.xid_fallback), None)
        self._xid_chain = next((r for r in self.rules if r.xid_chain), None)
        self.xid_catalog = xid_catalog if xid_catalog is not None else default_xid_catalog()
        # A catalog decision is reported under the category of the row that names the code.
        self._xid_category = {
            code: next((r for r in rows if not r.patterns), rows[-1]).category
            for code, rows in self._xid_rows.items()
        }
        self._line_rows = [
            r
            for r in self.rules
            if r.source == "log" and not r.xid and not r.xid_fallback and not r.xid_chain
        ]
        # Flat (rule, regex, anchor, any-of) lists in priority order: one loop per line; the
        # kernel-trace rows apart (tried only on a hung task's call trace).
        plan = [
            (r, rx, anchor, alts)
            for r in self._line_rows
            for rx, (anchor, alts) in zip(self._compiled[r.id], self._anchors[r.id], strict=True)
        ]
        self._line_plan = [p for p in plan if p[0].context != "kernel_trace"]
        self._trace_plan = [p for p in plan if p[0].context == "kernel_trace"]

    def __len__(self) -> int:
        return len(self.rules)

    def get(self, rule_id: str) -> Rule:
        return self._by_id[rule_id]

    def for_source(self, source: str) -> list[Rule]:
        return [r for r in self.rules if r.source == source]

    def _search(self, rule: Rule, line: str, low: str | None = None) -> dict[str, Any] | None:
        for rx, (anchor, alts) in zip(self._compiled[rule.id], self._anchors[rule.id], strict=True):
            if low is not None:
                if anchor is not None and anchor not in low:
                    continue
                if alts is not None and not any(a in low for a in alts):
                    continue
            m = rx.search(line)
            if m:
                return {k: _coerce(v) for k, v in m.groupdict().items() if v is not None}
        return None

    def match_line(
        self,
        line: str,
        *,
        in_traceback: bool = False,
        in_import: bool = False,
        in_kernel_trace: bool = False,
        from_node: bool | None = None,
    ) -> RuleMatch | None:
        """The first row matching one log line.

        ``in_traceback``: the line ends a Python traceback; ``in_import``: that traceback was
        raised while importing a module; ``in_kernel_trace``: the line is part of the kernel call
        trace after a ``trace_follows`` row (only ``kernel_trace`` rows are tried then);
        ``from_node``: the node exporter read the line from the node itself (True), a training
        process wrote it (False: ``origin: node`` rows and Xid rows are skipped), or unknown
        (None: a log file given to ``classify-log``; every row is tried).
        """
        low = line.lower() if line.isascii() else None
        process = from_node is False
        xid = None if in_kernel_trace or process else parse_xid(line)
        if xid is not None:
            if "caused_by" in xid and self._xid_chain is not None:
                return self._catalog_match(self._xid_chain, xid, xid["caused_by"])
            for r in self._xid_rows.get(xid["xid"], []):
                found = self._search(r, line, low) if r.patterns else {}
                if found is not None:
                    return RuleMatch(r, {**xid, **found})
            if self._xid_fallback is not None:
                return self._catalog_match(self._xid_fallback, xid, xid["xid"])
        for r, rx, anchor, alts in self._trace_plan if in_kernel_trace else self._line_plan:
            if low is not None:
                if anchor is not None and anchor not in low:
                    continue
                if alts is not None and not any(a in low for a in alts):
                    continue
            if (r.context == "traceback" and not in_traceback) or (r.context == "import" and not in_import):
                continue
            if process and r.origin == "node":
                continue
            m = rx.search(line)
            if m:
                return RuleMatch(r, {k: _coerce(v) for k, v in m.groupdict().items() if v is not None})
        return None

    def _catalog_match(self, rule: Rule, xid: dict[str, Any], code: int) -> RuleMatch:
        """``rule`` matched with the catalog's decision for ``code`` (the row's own if unlisted)."""
        decided = self.xid_catalog.decide(code)
        if decided is None:
            return RuleMatch(rule, xid)
        fields = {**xid, "catalog_xid": code, "catalog_bucket": self.xid_catalog.entry(code).bucket}
        return RuleMatch(rule, fields, *decided, category=self._xid_category.get(code, rule.category))

    def match_structured(self, source: str, fields: Mapping[str, Any]) -> list[RuleMatch]:
        """Every ``source`` row whose ``when`` holds on ``fields``."""
        return [RuleMatch(r, dict(fields)) for r in self.for_source(source) if when_holds(r.when, fields)]


def _coerce(v: str) -> Any:
    return int(v) if re.fullmatch(r"-?\d{1,18}", v) else v


def rules_from_rows(rows: Any, origin: str = "<rows>") -> list[Rule]:
    """Validate raw YAML rows (a list of mappings) into :class:`Rule` objects."""
    if not isinstance(rows, list):
        raise RuleTableError(f"{origin}: 'rules' must be a list of rows")
    out = []
    for i, row in enumerate(rows):
        where = f"{origin}: row {i}" + (f" ({row.get('id')!r})" if isinstance(row, dict) else "")
        try:
            out.append(from_mapping(Rule, row))
        except SchemaError as exc:
            raise RuleTableError(f"{where}: {exc}") from None
    return out


def _load_file(path: Path) -> list[Rule]:
    import yaml  # local: keeps the module importable for doc builds without PyYAML

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise RuleTableError(f"cannot read rule file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise RuleTableError(f"rule file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict) or set(data) - {"rules", "description"} or "rules" not in data:
        raise RuleTableError(f"rule file {path}: top level must be a mapping with a 'rules' list")
    return rules_from_rows(data["rules"], str(path))


def load_rule_table(path: str | Path | None = None) -> RuleTable:
    """Load a table from one YAML file or every ``*.yaml`` in a directory (default: built-in)."""
    p = Path(path) if path is not None else RULES_DIR
    files = sorted(p.glob("*.yaml")) if p.is_dir() else [p]
    if not files:
        raise RuleTableError(f"no *.yaml rule files in {p}")
    rules = [r for f in files for r in _load_file(f)]
    try:
        return RuleTable(rules)
    except RuleTableError as exc:
        raise RuleTableError(f"{p}: {exc}") from None


@cache
def default_rule_table() -> RuleTable:
    """The built-in table (``detectors/rules``), loaded once."""
    return load_rule_table()


# --- structured samples ---------------------------------------------------------------------

_THROTTLE_PREFIXES = ("nvml_", "clocks_throttle_reason_", "clocks_event_reason_")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def _growth(sample: Mapping[str, Any], name: str, prev_default: float | None = None) -> float | None:
    now, prev = _num(sample.get(name)), _num(sample.get(name + "_prev"))
    prev = prev_default if prev is None else prev
    return None if now is None or prev is None else now - prev


def _throttle(v: Any) -> list[str]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list | tuple | set):
        return []
    out = []
    for item in v:
        if isinstance(item, str):
            # "nvmlClocksThrottleReasonHwThermalSlowdown" / "HW Thermal Slowdown" -> "hw_thermal_slowdown"
            s = _CAMEL.sub("_", item.strip()).lower().replace(" ", "_")
            for pre in _THROTTLE_PREFIXES:
                s = s.removeprefix(pre)
            out.append(s)
    return out


def nvml_fields(sample: Mapping[str, Any]) -> dict[str, Any]:
    """Normalise one GPU's NVML sample and add derived fields for the ``nvml`` rows.

    Input keys: ``state`` ("ok", "lost", ...), ``ecc_volatile_uncorrected`` (int),
    ``remap_failure``/``remap_pending`` (bool), ``temperature_c`` (float),
    ``throttle_reasons`` (list of NVML reason names), ``pcie_replay_count`` and
    ``pcie_replay_count_prev`` (ints), optionally ``ecc_volatile_uncorrected_prev``.  Derived:
    ``pcie_replay_growth`` and ``ecc_volatile_uncorrected_growth`` (previous ECC count taken
    as 0 when absent).  Wrongly typed values are dropped, never raised.

    >>> nvml_fields({"pcie_replay_count": 40, "pcie_replay_count_prev": 10})["pcie_replay_growth"]
    30.0
    """
    if not isinstance(sample, Mapping):
        return {}
    out: dict[str, Any] = {k: v for k, v in sample.items() if isinstance(k, str)}
    if isinstance(out.get("state"), str):
        out["state"] = out["state"].strip().lower().replace(" ", "_")
    out["throttle_reasons"] = _throttle(sample.get("throttle_reasons"))
    out["pcie_replay_growth"] = _growth(sample, "pcie_replay_count")
    # No previous ECC sample: every uncorrected error counted so far is news to us.  PCIe replays
    # accumulate harmlessly over uptime, so their growth needs a real previous value.
    out["ecc_volatile_uncorrected_growth"] = _growth(sample, "ecc_volatile_uncorrected", prev_default=0.0)
    return out


def nic_fields(sample: Mapping[str, Any]) -> dict[str, Any]:
    """Normalise one interface's state sample for the ``nic`` rows.

    Input keys: ``interface``, ``operstate`` (sysfs: up/down/lowerlayerdown/...), ``carrier``
    (0/1), ``carrier_changes`` and ``carrier_changes_prev`` (sysfs counter), ``port_state``
    (IB: ACTIVE/DOWN/INIT/ARMED), ``never_up`` (the exporter has not seen the interface up).
    Derived: ``carrier_changes_growth``; ``never_up`` is always 0 or 1 (absent: 0, an interface
    that has been up -- what samples of exporters that do not tell meant).

    >>> f = nic_fields({"interface": "ib0", "carrier_changes": 9, "carrier_changes_prev": 5})
    >>> f["carrier_changes_growth"], f["never_up"]
    (4.0, 0)
    """
    if not isinstance(sample, Mapping):
        return {}
    out: dict[str, Any] = {k: v for k, v in sample.items() if isinstance(k, str)}
    out["never_up"] = 1 if sample.get("never_up") in (True, 1) else 0
    out["carrier_changes_growth"] = _growth(sample, "carrier_changes")
    # IB sysfs state reads "1: DOWN" / "4: ACTIVE": keep the word.
    if isinstance(out.get("port_state"), str):
        out["port_state"] = out["port_state"].split(":")[-1].strip().lower()
    return out


def match_nvml(sample: Mapping[str, Any], table: RuleTable | None = None) -> list[RuleMatch]:
    """Every ``nvml`` row matching one GPU's sample (no thresholds applied: pure)."""
    return (table or default_rule_table()).match_structured("nvml", nvml_fields(sample))


def match_nic_state(sample: Mapping[str, Any], table: RuleTable | None = None) -> list[RuleMatch]:
    """Every ``nic`` row matching one interface's state sample (no thresholds applied).

    >>> [m.rule.id for m in match_nic_state({"interface": "ib0", "operstate": "down", "carrier": 0})]
    ['nic-state-down']
    """
    return (table or default_rule_table()).match_structured("nic", nic_fields(sample))
