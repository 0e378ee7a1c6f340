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

from detectors.stacks.model import Frame, ProcessDump, ThreadStack, normalize_filename

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # a dump captured from a terminal keeps py-spy's colours
_THREAD = re.compile(
    r'^Thread (?P<tid>0x[0-9A-Fa-f]+|\d+)(?: \((?P<status>[^)]*)\))?(?:: "(?P<name>.*)")?\s*$'
)
_PROCESS = re.compile(r"^Process (?P<pid>\d+):")


class StackParseError(ValueError):
    """A dump is malformed; the message names the source file and where it went wrong."""


class DumpParser:
    """Parses py-spy dumps, sharing one ``Frame`` per distinct frame across every dump it sees."""

    def __init__(self) -> None:
        self._text_frames: dict[str, Frame] = {}
        self._json_frames: dict[tuple[str, str, int], Frame] = {}

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
        """Parse ``py-spy dump`` text output."""
        if "\x1b" in text:
            text = _ANSI.sub("", text)
        by_pid: dict[int, list[ThreadStack]] = {}
        cur_pid = pid
        header: tuple[int | None, str, bool | None] | None = None
        frames: list[Frame] = []

        def flush() -> None:
            if header is not None:
                assert cur_pid is not None
                by_pid.setdefault(cur_pid, []).append(
                    ThreadStack(header[0], header[1], header[2], tuple(frames))
                )

        for lineno, raw in enumerate(text.splitlines(), 1):
            if raw.startswith("    "):
                if raw.startswith("        "):
                    continue  # "Arguments:"/"Locals:" blocks from --locals
                if header is None:
                    raise StackParseError(f"{source}:{lineno}: frame line before any 'Thread' header")
                frames.append(self._text_frame(raw[4:].rstrip(), source, lineno))
                continue
            line = raw.strip()
            if line.startswith("Thread "):
                m = _THREAD.match(line)
                if m is None:
                    raise StackParseError(f"{source}:{lineno}: malformed thread header {line[:120]!r}")
                if cur_pid is None:
                    raise StackParseError(f"{source}:{lineno}: no 'Process <pid>:' header and no pid given")
                flush()
                tid_s, status = m.group("tid"), m.group("status")
                tid = int(tid_s, 16) if tid_s.startswith("0x") else int(tid_s)
                header = (tid, m.group("name") or "", None if status is None else "active" in status)
                frames = []
            elif line.startswith("Process "):
                m = _PROCESS.match(line)
                if m is None:
                    raise StackParseError(f"{source}:{lineno}: malformed process header {line[:120]!r}")
                flush()
                header, frames, cur_pid = None, [], int(m.group("pid"))
            elif not line or line.startswith(("Python v", "Parent Process ")) or set(line) == {"-"}:
                continue
            else:
                raise StackParseError(f"{source}:{lineno}: unexpected line {line[:120]!r}")
        flush()
        if not by_pid:
            raise StackParseError(f"{source}: no thread stacks found (is this a py-spy dump?)")
        return [ProcessDump(p, tuple(ts), source) for p, ts in by_pid.items()]

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
            where = f"{source}: [{i}]"
            if not isinstance(th, dict):
                raise StackParseError(f"{where}: expected a thread object, got {type(th).__name__}")
            tpid = _opt(th, "pid", int, where, pid)
            if tpid is None:
                raise StackParseError(f"{where}.pid: missing and no pid given")
            raw_frames = th.get("frames")
            if not isinstance(raw_frames, list):
                raise StackParseError(f"{where}.frames: expected a list")
            frames = tuple(self._json_frame(f, f"{where}.frames[{j}]") for j, f in enumerate(raw_frames))
            tid = _opt(th, "os_thread_id", int, where, None)
            if tid is None:
                tid = _opt(th, "thread_id", int, where, None)
            name = _opt(th, "thread_name", str, where, "") or ""
            active = _opt(th, "active", bool, where, None)
            by_pid.setdefault(tpid, []).append(ThreadStack(tid, name, active, frames))
        if not by_pid:
            raise StackParseError(f"{source}: no thread stacks found (empty JSON list)")
        return [ProcessDump(p, tuple(ts), source) for p, ts in by_pid.items()]

    def _json_frame(self, f: Any, where: str) -> Frame:
        if not isinstance(f, dict):
            raise StackParseError(f"{where}: expected a frame object, got {type(f).__name__}")
        name, filename = f.get("name"), f.get("short_filename") or f.get("filename")
        line = f.get("line", 0)
        if not isinstance(name, str) or not isinstance(filename, str):
            raise StackParseError(f"{where}: frame needs string 'name' and 'filename'")
        if isinstance(line, bool) or not isinstance(line, int):
            raise StackParseError(f"{where}.line: expected an integer, got {line!r:.40}")
        key = (name, filename, line)
        frame = self._json_frames.get(key)
        if frame is None:
            frame = self._json_frames[key] = Frame(name, normalize_filename(filename), line)
        return frame


def _opt(obj: dict[str, Any], key: str, tp: type, where: str, default: Any) -> Any:
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise StackParseError(f"{where}.{key}: expected {tp.__name__}, got {value!r:.40}")
    return value
