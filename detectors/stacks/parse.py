"""Parsers for ``py-spy dump`` output, text and ``--json``.

Both return one :class:`ProcessDump` per process in the output (one, or several when the dump
was taken with ``--subprocesses``).  Anything that is not a py-spy dump raises
:class:`StackParseError` naming the source and the offending line or JSON path.

A :class:`DumpParser` caches parsed frames: the ranks of one job repeat the same frames
thousands of times, and reusing one ``Frame`` object per distinct frame line keeps parsing a
9,600-rank job well under a second and lets later stages compare stacks by identity.
"""

from __future__ import annotations

import json
import re
from typing import Any

from trainguard.detectors.stacks.model import Frame, ProcessDump, ThreadStack, normalize_filename

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # a dump captured from a terminal keeps py-spy's colours
_EOL = r"(?:\r?\n|\Z)"
# One token of a text dump: a thread header plus its indented frame lines, a process header,
# or a line carrying nothing we need (interpreter version, parent process, separators, blanks).
_TOKEN = re.compile(
    r"(?P<thread>Thread (?P<tid>0x[0-9A-Fa-f]+|\d+)(?: \((?P<status>[^)\n]*)\))?"
    rf'(?:: "(?P<name>[^\n]*)")?[ \t]*{_EOL}(?P<body>(?:    [^\n]*{_EOL})*))'
    rf"|(?P<process>Process (?P<pid>\d+):[^\n]*{_EOL})"
    rf"|(?P<skip>(?:Python v[^\n]*|Parent Process [^\n]*|-+|[ \t]*){_EOL})"
)


class StackParseError(ValueError):
    """A dump is malformed; the message names the source file and where it went wrong."""


class DumpParser:
    """Parses py-spy dumps, sharing one ``Frame`` per distinct frame across every dump it sees."""

    def __init__(self) -> None:
        self._text_frames: dict[str, Frame] = {}
        self._blocks: dict[str, tuple[Frame, ...]] = {}
        self._json_frames: dict[tuple[str, str, int], Frame] = {}
        self._json_stacks: dict[tuple[int, ...], tuple[Frame, ...]] = {}

    def parse(self, text: str, fmt: str, source: str = "", pid: int | None = None) -> list[ProcessDump]:
        """Parse ``text`` as ``fmt`` (``"txt"`` or ``"json"``); ``pid`` fills in a missing header."""
        if fmt == "json":
            return self.parse_json(text, source, pid)
        if fmt in ("txt", "text"):
            return self.parse_text(text, source, pid)
        raise StackParseError(f"{source}: unknown dump format {fmt!r} (expected txt or json)")

    # -- text -----------------------------------------------------------------------------------

    def _text_frame(self, body: str, source: str, lineno: int) -> Frame:
        frame = self._text_frames.get(body)
        if frame is not None:
            return frame
        cut = body.rfind(" (")
        if cut <= 0 or not body.endswith(")"):
            raise StackParseError(f"{source}:{lineno}: not a frame line: {body[:120]!r}")
        name, loc = body[:cut], body[cut + 2 : -1]
        colon = loc.rfind(":")
        line = 0
        if colon > 0 and loc[colon + 1 :].isdigit():
            loc, line = loc[:colon], int(loc[colon + 1 :])
        frame = Frame(name, normalize_filename(loc), line)
        self._text_frames[body] = frame
        return frame

    def parse_text(self, text: str, source: str = "", pid: int | None = None) -> list[ProcessDump]:
        """Parse ``py-spy dump`` text output.

        The text is consumed token by token with one compiled regex (headers, blank lines, a
        thread header with its indented frame block), so every byte is accounted for -- an
        unknown line is an error -- while a frame block seen before is a dictionary hit.
        """
        if "\x1b" in text:
            text = _ANSI.sub("", text)
        by_pid: dict[int, list[ThreadStack]] = {}
        cur_pid = pid
        pos, end = 0, len(text)
        while pos < end:
            m = _TOKEN.match(text, pos)
            if m is None or m.end() == pos:
                raise self._text_error(text, pos, source)
            pos = m.end()
            kind = m.lastgroup
            if kind == "thread":
                if cur_pid is None:
                    raise self._text_error(
                        text, m.start(), source, "no 'Process <pid>:' header and no pid given"
                    )
                tid_s, status = m.group("tid"), m.group("status")
                tid = int(tid_s, 16) if tid_s.startswith("0x") else int(tid_s)
                frames = self._block(m.group("body"), text, m.start("body"), source)
                active = None if status is None else "active" in status
                by_pid.setdefault(cur_pid, []).append(ThreadStack(tid, m.group("name") or "", active, frames))
            elif kind == "process":
                cur_pid = int(m.group("pid"))
        if not by_pid:
            raise StackParseError(f"{source}: no thread stacks found (is this a py-spy dump?)")
        return [ProcessDump(p, tuple(ts), source) for p, ts in by_pid.items()]

    def _block(self, body: str, text: str, offset: int, source: str) -> tuple[Frame, ...]:
        frames = self._blocks.get(body)
        if frames is None:
            out = []
            for i, raw in enumerate(body.splitlines()):
                if raw.startswith("        "):
                    continue  # "Arguments:"/"Locals:" blocks from --locals
                lineno = text.count("\n", 0, offset) + 1 + i
                out.append(self._text_frame(raw[4:].rstrip(), source, lineno))
            frames = self._blocks[body] = tuple(out)
        return frames

    @staticmethod
    def _text_error(text: str, pos: int, source: str, why: str = "") -> StackParseError:
        lineno = text.count("\n", 0, pos) + 1
        line = text[pos : text.find("\n", pos) if "\n" in text[pos:] else len(text)].strip()
        if not why:
            if line.startswith("Thread "):
                why = f"malformed thread header {line[:120]!r}"
            elif line.startswith("Process "):
                why = f"malformed process header {line[:120]!r}"
            elif text[pos : pos + 4] == "    ":
                why = f"frame line before any 'Thread' header: {line[:120]!r}"
            else:
                why = f"unexpected line {line[:120]!r}"
        return StackParseError(f"{source}:{lineno}: {why}")

    # -- json -----------------------------------------------------------------------------------

    def parse_json(self, text: str, source: str = "", pid: int | None = None) -> list[ProcessDump]:
        """Parse ``py-spy dump --json`` output (a list of thread objects)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StackParseError(
                f"{source}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
            ) from None
        if not isinstance(data, list):
            raise StackParseError(f"{source}: expected a JSON list of threads, got {type(data).__name__}")
        by_pid: dict[int, list[ThreadStack]] = {}
        for i, th in enumerate(data):
            if not isinstance(th, dict):
                raise StackParseError(f"{source}: [{i}]: expected a thread object, got {type(th).__name__}")
            tpid = _opt(th, "pid", int, source, i, pid)
            if tpid is None:
                raise StackParseError(f"{source}: [{i}].pid: missing and no pid given")
            raw_frames = th.get("frames")
            if not isinstance(raw_frames, list):
                raise StackParseError(f"{source}: [{i}].frames: expected a list")
            frames = self._json_stack(raw_frames, source, i)
            tid = _opt(th, "os_thread_id", int, source, i, None)
            if tid is None:
                tid = _opt(th, "thread_id", int, source, i, None)
            name = _opt(th, "thread_name", str, source, i, "") or ""
            active = _opt(th, "active", bool, source, i, None)
            by_pid.setdefault(tpid, []).append(ThreadStack(tid, name, active, frames))
        if not by_pid:
            raise StackParseError(f"{source}: no thread stacks found (empty JSON list)")
        return [ProcessDump(p, tuple(ts), source) for p, ts in by_pid.items()]

    def _json_stack(self, raw_frames: list[Any], source: str, i: int) -> tuple[Frame, ...]:
        cache = self._json_frames
        frames = []
        for j, f in enumerate(raw_frames):
            try:
                # Fast path: these exact values were validated when first seen.
                frame = cache[(f["name"], f.get("short_filename") or f["filename"], f.get("line", 0))]
            except (KeyError, TypeError, AttributeError):
                frame = self._json_frame(f, f"{source}: [{i}]", j)
            frames.append(frame)
        # Frames are shared objects, so their ids identify the stack: one tuple per distinct stack.
        key = tuple(map(id, frames))
        stack = self._json_stacks.get(key)
        if stack is None:
            stack = self._json_stacks[key] = tuple(frames)
        return stack

    def _json_frame(self, f: Any, where: str, j: int) -> Frame:
        if not isinstance(f, dict):
            raise StackParseError(f"{where}.frames[{j}]: expected a frame object, got {type(f).__name__}")
        name, filename = f.get("name"), f.get("short_filename") or f.get("filename")
        line = f.get("line", 0)
        if not isinstance(name, str) or not isinstance(filename, str):
            raise StackParseError(f"{where}.frames[{j}]: frame needs string 'name' and 'filename'")
        if isinstance(line, bool) or not isinstance(line, int):
            raise StackParseError(f"{where}.frames[{j}].line: expected an integer, got {line!r:.40}")
        key = (name, filename, line)
        frame = self._json_frames.get(key)
        if frame is None:
            frame = self._json_frames[key] = Frame(name, normalize_filename(filename), line)
        return frame


def _opt(obj: dict[str, Any], key: str, tp: type, source: str, i: int, default: Any) -> Any:
    value = obj.get(key)
    if value is None:
        return default
    if type(value) is not tp:  # exact: a bool is not an int here
        raise StackParseError(f"{source}: [{i}].{key}: expected {tp.__name__}, got {value!r:.40}")
    return value
