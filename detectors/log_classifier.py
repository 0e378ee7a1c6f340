"""Classify log lines, NVML/NIC samples and exit codes against the rule table.

:class:`LogClassifier` wraps a :class:`~trainguard.detectors.rule_table.RuleTable` with the state the table
itself does not keep:

* **thresholds** -- rows with ``count``/``window_s`` are counted per key in a
  :class:`~trainguard.detectors.windows.WindowTracker`, on the caller's timestamps (or the line's own
  timestamp; never the wall clock);
* **Python tracebacks** -- :meth:`LogClassifier.feed` follows ``Traceback (most recent call
  last):`` blocks line by line, separately per ``[rankN]:`` prefix so interleaved ranks do not
  mix, and classifies the final ``XxxError: msg`` line with the traceback's user module (the
  last frame outside site-packages, the stdlib and torch) and whether it was raised while
  importing a module (``import_time``: the ``import`` rows apply);
* **kernel call traces** -- after a ``trace_follows`` row (a hung task) the next lines of the
  same host are also tried against the ``kernel_trace`` rows (a frame in a shared filesystem).

:func:`classify_exit` does the same for a process exit code / signal plus optional traceback.

>>> c = LogClassifier()
>>> for line in ['[rank1]: Traceback (most recent call last):',
...              '[rank0]: Traceback (most recent call last):',
...              '[rank1]:   File "/workspace/llm/train.py", line 88, in step',
...              '[rank0]:   File "/workspace/llm/data.py", line 12, in batch',
...              '[rank1]:     loss = model(x) + aux',
...              "[rank1]: TypeError: unsupported operand type(s) for +: 'Tensor' and 'NoneType'"]:
...     r = c.feed(line)
>>> r.action.value, r.rule, r.fields["user_module"], r.fields["rank"]
('rollback', 'user-exception', '/workspace/llm/train.py', 1)
>>> classify_exit(137).rule
'exit-sigkill'
"""

from __future__ import annotations

import math
import re
import signal as _signal
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from trainguard.detectors.findings import Finding
from trainguard.detectors.rule_table import (
    RuleMatch,
    RuleTable,
    default_rule_table,
    match_nic_state,
    match_nvml,
)
from trainguard.detectors.windows import WindowCounter, WindowTracker
from trainguard.schemas.enums import Action, Severity


@dataclass(frozen=True)
class ClassifierConfig:
    """Settings of :class:`LogClassifier` (thresholds themselves live in the rule table)."""

    #: a traceback frame whose path contains one of these is library code, not the user's.
    library_markers: list[str] = field(
        default_factory=lambda: [
            "site-packages",
            "dist-packages",
            "/torch/",
            "<frozen",
            "<string>",
            "<stdin>",
        ]
    )
    #: a frame whose path matches this regex is in the Python standard library.
    stdlib_pattern: str = r"[/\\]lib[/\\]python\d+(?:\.\d+)?[/\\]"
    #: downgrade rollback to diagnose when a traceback has no user frame to blame.
    require_user_frame: bool = False
    max_frames: int = field(default=256, metadata={"lo": 1, "hi": 100_000})
    #: open tracebacks tracked at once (one per rank prefix); the oldest is dropped beyond it.
    max_streams: int = field(default=4096, metadata={"lo": 1, "hi": 10_000_000})
    max_window_keys: int = field(default=50_000, metadata={"lo": 1, "hi": 10_000_000})
    #: lines after a ``trace_follows`` row that are tried against the ``kernel_trace`` rows.
    kernel_trace_lines: int = field(default=64, metadata={"lo": 0, "hi": 10_000})


@dataclass(frozen=True)
class Classification:
    """The verdict for one input (a log line, an NVML/NIC sample or an exit status)."""

    line: str
    action: Action = Action.NONE
    category: str | None = None
    severity: Severity | None = None
    rule: str | None = None
    #: extracted fields: xid, pci, pid, interface, rank, exception, user_module...
    fields: dict[str, Any] = field(default_factory=dict)
    #: occurrences in the row's window (1 for rows without a threshold, 0 if nothing matched).
    count: int = 0
    #: the row's threshold was reached (the action is the escalated one).
    escalated: bool = False
    ts: float | None = None
    source: str = "log"

    @property
    def matched(self) -> bool:
        return self.rule is not None

    def to_json(self) -> dict[str, Any]:
        """The ``classify-log --json`` record: exactly line, category, severity, action, rule."""
        return {
            "line": self.line,
            "category": self.category,
            "severity": self.severity.value if self.severity else None,
            "action": self.action.value,
            "rule": self.rule,
        }

    def to_finding(self, *, job: str | None = None, node: str | None = None) -> Finding | None:
        """The equivalent :class:`~trainguard.detectors.findings.Finding`, or None if no rule matched."""
        if self.rule is None or self.category is None or self.severity is None:
            return None
        rank = self.fields.get("rank")
        return Finding(
            kind=f"{self.source}_rule",
            category=self.category,
            severity=self.severity,
            action=self.action,
            job=job,
            ranks=(rank,) if isinstance(rank, int) else (),
            node=node,
            score=float(self.count),
            evidence={"rule": self.rule, "line": self.line, "escalated": self.escalated, **self.fields},
            ts=self.ts,
        )


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str


# --- prefixes and timestamps ------------------------------------------------------------------

_TS_PREFIXES = (
    re.compile(r"\[?\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?\]?\s*"),
    re.compile(r"\[\s*\d+\.\d+\]\s*"),
    re.compile(r"\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) [A-Z][a-z]{2} +\d{1,2} \d{2}:\d{2}:\d{2} \d{4}\]\s*"),
    re.compile(r"[A-Z][a-z]{2} +\d{1,2} \d{2}:\d{2}:\d{2}\s+\S+\s+[\w./@-]+(?:\[\d+\])?:\s*"),
)
# torchrun/elastic "[rank3]:" and "[default3]:", mpirun --tag-output "[1,3]<stderr>:".
_RANK = re.compile(r"\[(?:rank|default)\s*(?P<a>\d+)\]:?\s?|\[\d+,(?P<b>\d+)\]<std(?:out|err)>:\s?", re.I)
_SRUN = re.compile(r"(?P<c>\d{1,6}):\s")  # srun --label "3: "
_ISO = re.compile(
    r"^\s*\[?(?P<d>\d{4}-\d{2}-\d{2})[T ](?P<t>\d{2}:\d{2}:\d{2})"
    r"(?:[.,](?P<f>\d+))?(?P<z>Z|[+-]\d{2}:?\d{2})?"
)
_DMESG = re.compile(r"^\s*\[\s*(?P<s>\d+\.\d+)\]")
_SYSLOG = re.compile(r"^\s*(?P<mon>[A-Z][a-z]{2}) +(?P<day>\d{1,2}) (?P<t>\d{2}:\d{2}:\d{2})\b")
_MONTHS = {
    m: i + 1
    for i, m in enumerate(
        ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
    )
}

_TB_START = re.compile(r"Traceback \(most recent call last\):")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>.+?))?\s*$')
_EXC_COLON = re.compile(r"^(?P<exc>(?:[A-Za-z_]\w*\.)*[A-Z]\w*):(?:\s?(?P<msg>.*))?$")
_EXC_BARE = re.compile(
    r"^(?P<exc>(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Interrupt|Exit|Warning|Iteration))\s*$"
)


def split_prefix(line: str) -> tuple[str, int | None]:
    """(content, rank): the line without timestamp/host/rank prefixes, and the rank if any.

    >>> split_prefix("2024-05-01T10:00:00Z node-3 [rank12]:   File \\"a.py\\", line 1, in f")
    ('  File "a.py", line 1, in f', 12)
    >>> split_prefix("Jun  3 08:21:17 node-12 kernel: ib0: Link down")
    ('ib0: Link down', None)
    """
    m = _RANK.search(line, 0, 200)
    if m:
        return line[m.end() :], int(m.group("a") or m.group("b"))
    pos = 0
    for _ in range(4):
        for rx in _TS_PREFIXES:
            pm = rx.match(line, pos)
            if pm and pm.end() > pos:
                pos = pm.end()
                break
        else:
            break
    sm = _SRUN.match(line, pos)
    if sm:
        return line[sm.end() :], int(sm.group("c"))
    return line[pos:], None


def parse_timestamp(line: str) -> float | None:
    """Seconds from the line's leading timestamp (ISO 8601, dmesg uptime, syslog), else None.

    ISO timestamps without a zone are taken as UTC; syslog lines carry no year, so they are
    placed in 2001 (only differences between lines matter for windows).

    >>> parse_timestamp("2024-05-01T00:00:05.5Z x"), parse_timestamp("[  12.250000] x")
    (1714521605.5, 12.25)
    >>> parse_timestamp("no time here") is None
    True
    """
    if m := _DMESG.match(line):
        return float(m.group("s"))
    try:
        if m := _ISO.match(line):
            frac = float("0." + m.group("f")) if m.group("f") else 0.0
            zone = (m.group("z") or "+00:00").replace("Z", "+00:00")
            if len(zone) == 5:
                zone = zone[:3] + ":" + zone[3:]
            dt = datetime.fromisoformat(f"{m.group('d')}T{m.group('t')}{zone}")
            return dt.timestamp() + frac
        if (m := _SYSLOG.match(line)) and m.group("mon") in _MONTHS:
            h, mi, s = (int(x) for x in m.group("t").split(":"))
            dt = datetime(2001, _MONTHS[m.group("mon")], int(m.group("day")), h, mi, s, tzinfo=UTC)
            return dt.timestamp()
    except ValueError:  # 2024-13-45 and friends: no usable time, not an error
        return None
    return None


# --- the classifier ----------------------------------------------------------------------------


@dataclass
class _OpenTraceback:
    frames: list[Frame] = field(default_factory=list)
    expect_code: bool = False


class LogClassifier:
    """Rule-table classifier with window thresholds and per-rank traceback tracking.

    Parameters
    ----------
    table
        Rule table; default: the built-in ``detectors/rules``.
    config
        :class:`ClassifierConfig`.

    Examples
    --------
    >>> c = LogClassifier()
    >>> line = "mlx5_core 0000:5e:00.0 ib0: Link down"
    >>> c.classify(line, ts=0.0).action.value, c.classify(line, ts=120.0).action.value
    ('ignore', 'evict')
    >>> c.classify("iteration 100 | loss 2.31").action.value
    'none'
    """

    def __init__(self, table: RuleTable | None = None, config: ClassifierConfig | None = None) -> None:
        self.table = table if table is not None else default_rule_table()
        self.config = config or ClassifierConfig()
        self._windows = WindowTracker(self.config.max_window_keys)
        #: hosts whose windows were observed since :meth:`take_touched`.
        self._touched: set[str | None] = set()
        self._open: OrderedDict[tuple[str | None, int | None], _OpenTraceback] = OrderedDict()
        self._stdlib = re.compile(self.config.stdlib_pattern)
        self._last_ts = 0.0
        #: host -> lines left of the kernel call trace after a ``trace_follows`` row.
        self._ktrace: OrderedDict[str | None, int] = OrderedDict()

    # ---- single inputs

    def classify(
        self, line: str, *, ts: float | None = None, host: str | None = None, from_node: bool | None = None
    ) -> Classification:
        """Classify one line on its own (no traceback context); thresholds are counted.

        ``from_node``: see :meth:`RuleTable.match_line` (False: a training process wrote it)."""
        if not isinstance(line, str):
            return Classification(line=str(line))
        m = self.table.match_line(line, from_node=from_node)
        if m is None:
            return Classification(line=line, ts=ts)
        _, rank = split_prefix(line)
        return self._decide(line, m, {"rank": rank} if rank is not None else {}, ts, host)

    def classify_nvml(
        self, sample: Mapping[str, Any], *, ts: float | None = None, host: str | None = None
    ) -> list[Classification]:
        """Every ``nvml`` row matching one GPU's sample, thresholds applied (key e.g. ``gpu``)."""
        return [self._decide("", m, {}, ts, host, source="nvml") for m in match_nvml(sample, self.table)]

    def classify_nic(
        self, sample: Mapping[str, Any], *, ts: float | None = None, host: str | None = None
    ) -> list[Classification]:
        """Every ``nic`` row matching one interface's state sample, thresholds applied."""
        return [self._decide("", m, {}, ts, host, source="nic") for m in match_nic_state(sample, self.table)]

    # ---- streams with tracebacks

    def feed(
        self, line: str, *, ts: float | None = None, host: str | None = None, from_node: bool | None = None
    ) -> Classification:
        """Classify the next line of a log stream, following Python tracebacks.

        Lines inside a traceback (the header, frames, source lines) classify as ``none``; the
        final exception line gets the classification, with ``exception``, ``user_module``,
        ``user_line`` and ``user_function`` fields when a user frame exists.  ``from_node``: who
        wrote the stream (:meth:`RuleTable.match_line`); the node's own rows fire on its lines only.
        """
        if not isinstance(line, str):
            return Classification(line=str(line))
        content, rank = split_prefix(line)
        stream = (host, rank)
        if _TB_START.search(content):
            self._open[stream] = _OpenTraceback()
            self._open.move_to_end(stream)
            while len(self._open) > self.config.max_streams:
                self._open.popitem(last=False)
            return Classification(line=line, ts=ts)
        tb = self._open.get(stream)
        if tb is None:
            return self._plain(line, ts, host, from_node)
        if fm := _FRAME.match(content):
            if len(tb.frames) < self.config.max_frames:
                tb.frames.append(Frame(fm.group("file"), int(fm.group("line")), fm.group("func") or "?"))
            tb.expect_code = True
            return Classification(line=line, ts=ts)
        text = content.strip()
        exc = _EXC_COLON.match(text) or _EXC_BARE.match(text)
        if not text or content[:1] in (" ", "\t") or (tb.expect_code and not exc):
            tb.expect_code = False  # a source line, a ^^^^ marker or an exception-group border
            return Classification(line=line, ts=ts)
        del self._open[stream]
        if exc is None:  # the traceback was cut off; this is an ordinary line again
            return self._plain(line, ts, host, from_node)
        return self._exception(line, exc.group("exc"), tb.frames, rank, ts, host, from_node)

    def _plain(self, line: str, ts: float | None, host: str | None, from_node: bool | None) -> Classification:
        """A line outside a Python traceback: the kernel-trace rows first where one is open."""
        left = self._ktrace.pop(host, 0)
        if left > 0:
            m = self.table.match_line(line, in_kernel_trace=True, from_node=from_node)
            if m is not None:  # the frame names the subsystem the task hung in: that is the finding
                _, rank = split_prefix(line)
                return self._decide(line, m, {"rank": rank} if rank is not None else {}, ts, host)
            if left > 1:
                self._ktrace[host] = left - 1
        c = self.classify(line, ts=ts, host=host, from_node=from_node)
        if c.rule is not None and self.table.get(c.rule).trace_follows and self.config.kernel_trace_lines:
            self._ktrace[host] = self.config.kernel_trace_lines
            self._ktrace.move_to_end(host)
            while len(self._ktrace) > self.config.max_streams:
                self._ktrace.popitem(last=False)
        return c

    def _exception(
        self,
        line: str,
        exc: str,
        frames: list[Frame],
        rank: int | None,
        ts: float | None,
        host: str | None,
        from_node: bool | None = None,
    ) -> Classification:
        fields: dict[str, Any] = {"exception": exc, "frames": len(frames)}
        if rank is not None:
            fields["rank"] = rank
        user = self.user_frame(frames)
        if user is not None:
            fields.update(user_module=user.file, user_line=user.line, user_function=user.function)
        import_time = raised_at_import(frames, exc)
        if import_time:
            fields["import_time"] = True
        m = self.table.match_line(line, in_traceback=True, in_import=import_time, from_node=from_node)
        if m is None:
            return Classification(line=line, fields=fields, ts=ts)
        out = self._decide(line, m, fields, ts, host)
        if (
            out.action is Action.ROLLBACK
            and user is None
            and self.config.require_user_frame
            and m.rule.context != "import"
        ):
            # No user frame to blame: a crash without a culprit (ByteRobust step 3), not step 2.
            return Classification(
                line=line,
                action=Action.DIAGNOSE,
                category=out.category,
                severity=out.severity,
                rule=out.rule,
                fields={**out.fields, "culprit": None},
                count=out.count,
                escalated=out.escalated,
                ts=out.ts,
            )
        return out

    def user_frame(self, frames: list[Frame]) -> Frame | None:
        """The last frame outside library code (site-packages, stdlib, torch), if any."""
        for f in reversed(frames):
            path = f.file.replace("\\", "/")
            if any(mark in path for mark in self.config.library_markers) or self._stdlib.search(path):
                continue
            return f
        return None

    def take_touched(self) -> set[str | None]:
        """The hosts whose count windows changed since the last call."""
        out, self._touched = self._touched, set()
        return out

    def windows_of(self, node: str) -> list[tuple[Any, WindowCounter]]:
        """The count windows of ``node`` (its own and its ``node/source`` streams')."""
        return [(k, c) for k, c in self._windows.items() if _of_node(k, node)]

    def window_nodes(self) -> set[str]:
        return {
            str(k[1]).split("/", 1)[0]
            for k, _ in self._windows.items()
            if isinstance(k, tuple) and _keyed_by_host(k)
        }

    def restore_windows(self, node: str, windows: list[tuple[Any, WindowCounter]]) -> None:
        """Replace the count windows of ``node`` with ``windows`` (from :meth:`windows_of`)."""
        for k, _ in self.windows_of(node):
            self._windows.remove(k)
        for k, c in windows:
            self._windows.put(tuple(k) if isinstance(k, list) else k, c)

    def flush(self) -> None:
        """Forget open tracebacks and kernel traces (end of a stream, or a stream restarted)."""
        self._open.clear()
        self._ktrace.clear()

    # ---- shared decision

    def _resolve_ts(self, ts: float | None, line: str) -> float:
        if ts is None or not math.isfinite(ts):
            ts = parse_timestamp(line) if line else None
        if ts is not None:
            self._last_ts = ts
        # No time at all: count at the last known time (0 at the start), so repeats in an
        # untimed file count as simultaneous -- deterministic, and dedup_s still applies.
        return self._last_ts

    def _decide(
        self,
        line: str,
        m: RuleMatch,
        extra: dict[str, Any],
        ts: float | None,
        host: str | None,
        source: str = "log",
    ) -> Classification:
        rule = m.rule
        fields = {**m.fields, **extra}
        count = 1
        when = self._resolve_ts(ts, line)
        if rule.thresholded and rule.window_s is not None:
            key = (rule.id, host, *(_hashable(fields.get(k)) for k in rule.key))
            count = self._windows.observe(key, when, rule.window_s, rule.dedup_s)
            self._touched.add(host)
        action, severity, escalated = m.decide(count)
        return Classification(
            line=line,
            action=action,
            category=m.category or rule.category,
            severity=severity,
            rule=rule.id,
            fields=fields,
            count=count,
            escalated=escalated,
            ts=ts if ts is not None else (when if line and parse_timestamp(line) is not None else None),
            source=source,
        )


_IMPORT_ERRORS = ("ImportError", "ModuleNotFoundError")


def raised_at_import(frames: list[Frame], exception: str = "") -> bool:
    """True if a traceback's frames show it was raised while a module was being imported.

    A module's top-level code runs as ``<module>``: the script's own is the first such frame
    (after ``runpy`` for ``python -m``), so a second one is an imported module's.  For
    ``importlib.import_module`` and lazy imports, an ``importlib`` frame followed by a module's
    top-level code says the same, and so does an ImportError raised under importlib.

    >>> raised_at_import([Frame("train.py", 3, "<module>"),
    ...                   Frame("/venv/site-packages/x/__init__.py", 9, "<module>")])
    True
    >>> raised_at_import([Frame("/usr/lib/python3.11/runpy.py", 198, "_run_module_as_main"),
    ...                   Frame("train.py", 30, "<module>"), Frame("train.py", 12, "main")])
    False
    """
    if sum(1 for f in frames if f.function == "<module>") >= 2:
        return True
    first = next((i for i, f in enumerate(frames) if "importlib" in f.file), None)
    if first is None:
        return False
    return exception.rsplit(".", 1)[-1] in _IMPORT_ERRORS or any(
        f.function == "<module>" for f in frames[first + 1 :]
    )


def _keyed_by_host(key: Any) -> bool:
    return isinstance(key, tuple) and len(key) >= 2 and isinstance(key[1], str)


def _of_node(key: Any, node: str) -> bool:
    return _keyed_by_host(key) and (key[1] == node or key[1].startswith(node + "/"))


def _hashable(v: Any) -> Any:
    return v if isinstance(v, str | int | float | bool | type(None)) else repr(v)


# --- exit codes ----------------------------------------------------------------------------------


def _to_int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and re.fullmatch(r"\s*-?\d{1,9}\s*", v):
        return int(v)
    return None


def _signal_number(v: Any) -> int | None:
    n = _to_int(v)
    if n is not None:
        return abs(n) if n else None
    if isinstance(v, str):
        name = v.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        try:
            return int(_signal.Signals[name])
        except KeyError:
            return None
    return None


def exit_fields(exit_code: Any, signal: Any = None) -> dict[str, Any]:
    """Normalised exit status: ``exit_code``, ``signal`` and ``signal_name``.

    The signal comes from ``signal`` (number or name), a negative return code (Python's
    ``subprocess``: ``-9``), or the shell's ``128 + N`` convention (137 -> 9).

    >>> exit_fields(137)
    {'exit_code': 137, 'signal': 9, 'signal_name': 'SIGKILL'}
    >>> exit_fields("garbage", "SIGSEGV")
    {'exit_code': None, 'signal': 11, 'signal_name': 'SIGSEGV'}
    """
    code = _to_int(exit_code)
    sig = _signal_number(signal)
    if sig is None and code is not None:
        if code < 0:
            sig = -code
        elif 128 < code <= 128 + 64:
            sig = code - 128
    try:
        name = _signal.Signals(sig).name if sig is not None else None
    except ValueError:
        name = None
    return {"exit_code": code, "signal": sig, "signal_name": name}


def classify_exit(
    exit_code: Any,
    signal: Any = None,
    traceback_text: str | None = None,
    *,
    table: RuleTable | None = None,
    config: ClassifierConfig | None = None,
) -> Classification:
    """Classify a finished process from its exit status and, if given, its traceback/log tail.

    A culprit in ``traceback_text`` (a user exception with its module, a CUDA/NCCL error) wins
    over the bare exit status: the whole-log verdict of the text
    (:func:`~trainguard.detectors.verdict.log_verdict`: its earliest root cause, tracebacks as
    one unit, echoes such as watchdog timeouts yielding).  Without one, the ``exit`` rows decide
    (137/SIGKILL: OOM-kill suspicion, 139 SIGSEGV, 134 SIGABRT, plain 1: no culprit -> diagnose).

    >>> tb = 'Traceback (most recent call last):\\n  File "/app/model.py", line 3, in f\\nKeyError: 3'
    >>> r = classify_exit(1, None, tb)
    >>> r.action.value, r.fields["user_module"], r.fields["exit_code"]
    ('rollback', '/app/model.py', 1)
    >>> classify_exit(1).action.value, classify_exit(139).rule, classify_exit(None).action.value
    ('diagnose', 'exit-sigsegv', 'none')
    """
    tbl = table if table is not None else default_rule_table()
    status = exit_fields(exit_code, signal)
    if isinstance(traceback_text, str) and traceback_text.strip():
        from trainguard.detectors.verdict import log_verdict  # verdict builds on this module

        # The traceback is the process's own text: it cannot speak for the node's kernel.
        verdict = log_verdict(traceback_text.splitlines(), table=tbl, config=config, from_node=False)
        best = verdict.classification if verdict.action not in (Action.NONE, Action.IGNORE) else None
        if best is not None:
            return Classification(
                line=best.line,
                action=best.action,
                category=best.category,
                severity=best.severity,
                rule=best.rule,
                fields={**best.fields, **status},
                count=best.count,
                escalated=best.escalated,
                source="exit",
            )
    if status["exit_code"] is None and status["signal"] is None:
        return Classification(line="", fields=status, source="exit")
    for m in tbl.match_structured("exit", status):
        action, severity, _ = m.rule.decide(1)
        return Classification(
            line="",
            action=action,
            category=m.rule.category,
            severity=severity,
            rule=m.rule.id,
            fields=status,
            count=1,
            source="exit",
        )
    return Classification(line="", fields=status, source="exit")
