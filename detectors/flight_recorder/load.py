"""Reading PyTorch Flight Recorder dumps: one file per rank, in PyTorch's pickle or JSON format.

PyTorch names a rank's dump ``<prefix><rank>`` (the prefix is whatever ``TORCH_FR_DUMP_TEMP_FILE``,
or for NCCL ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, was set to); :func:`load_dump_dir` reads such a
directory, one prefix per directory.  A dump holds ``version``, ``pg_config`` (each process
group's name, description and global ranks) and ``entries``: the rank's last collectives and
point-to-point operations, each with its group, sequence id, op, sizes and state.

What the gloo backend of torch 2.13 records (measured on its own dumps, ``scripts/capture_fr_fixtures.py``):
every collective, in state ``scheduled`` for good and ``retired`` once done (so ``retired`` counts
as completed here); no point-to-point operations; a ``pg_config`` without the groups' ranks
(the analysis infers them, see :mod:`trainguard.detectors.flight_recorder.analysis`).

A pickle is code: it is read with an unpickler that builds plain containers and scalars only and
refuses any class or function a file names (:class:`FlightRecorderError`), so a dump from an
untrusted node cannot run anything here.  It is data too, and small data can be large: a pickle's
memo lets a few KB name one list millions of times, and one opcode byte can make a 216-byte set.
So every dump has a **budget** (:class:`Budget`), scaled to its size: what the unpickler creates is
counted as it goes (refused before it is built), and the document it returns -- or JSON's -- is
walked once, every reference counted, before anything else reads it.  A dump over budget is a
:class:`FlightRecorderError` saying so, within milliseconds (``tests/detectors/test_fr_budget.py``).
File reading only: no network, no subprocesses.
"""

from __future__ import annotations

import ast
import io
import json
import pickle
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class FlightRecorderError(ValueError):
    """A file that is not a Flight Recorder dump we can read (named in the message)."""


#: Dump versions read here: PyTorch 2.x writes "2.<minor>".
SUPPORTED_MAJOR = "2"
#: Entry states, in the order a collective passes through them.
STATES = ("scheduled", "started", "completed")
#: Bounds on what one dump may hold (a recorder's ring buffer is 2,000 entries by default): a
#: pickle's memo can make a few KB reference one list millions of times.
MAX_ENTRIES = 200_000
MAX_TENSORS = 64  # sizes kept per entry
MAX_DIMS = 16


@dataclass(frozen=True, slots=True)
class Budget:
    """What one dump of ``size`` bytes may become, each counted per reference (an object named
    twice counts twice: that is what every later reader -- the parser, the JSON of the event --
    pays): ``elements`` (every container, key, value and item) and ``text`` (characters and bytes
    of its strings).  ``memory`` bounds what the unpickler builds meanwhile (an estimate: the file
    itself, a reference per opcode and each new container's size).

    Measured on PyTorch's own pickles (``tests/fixtures/flight_recorder*``): 0.4-0.5 elements,
    3-4 characters and 6-8 bytes of memory per byte of dump.  The budget allows 8, 32 and 32
    per byte (at least :data:`FLOOR_*`, at most :data:`MAX_*`): a real dump is far inside, a bomb
    (100x and more) far out.
    """

    elements: int
    text: int
    memory: int

    @classmethod
    def of(cls, size: int) -> Budget:
        return cls(
            elements=min(MAX_ELEMENTS, max(FLOOR_ELEMENTS, 8 * size)),
            text=min(MAX_TEXT, max(FLOOR_BYTES, 32 * size)),
            memory=min(MAX_MEMORY, max(FLOOR_BYTES, 32 * size)),
        )


#: the budget's bounds (see :class:`Budget`): a dump of 2,000 entries (PyTorch's default ring
#: buffer) holds about 180,000 elements and 1.5 MB of text.
FLOOR_ELEMENTS = 65_536
FLOOR_BYTES = 4 << 20
MAX_ELEMENTS = 8_000_000
MAX_TEXT = 256 << 20
MAX_MEMORY = 512 << 20

#: what the opcodes that build a container add to the unpickler's memory estimate (CPython's
#: size of the empty container); every opcode adds a reference (8 bytes) besides.
_CONTAINER_OPS = {
    pickle.EMPTY_LIST[0]: sys.getsizeof([]),
    pickle.LIST[0]: sys.getsizeof([]),
    pickle.EMPTY_DICT[0]: sys.getsizeof({}),
    pickle.DICT[0]: sys.getsizeof({}),
    pickle.EMPTY_SET[0]: sys.getsizeof(set()),
    pickle.FROZENSET[0]: sys.getsizeof(frozenset()),
    pickle.TUPLE[0]: sys.getsizeof(()),
    pickle.TUPLE1[0]: sys.getsizeof((0,)),
    pickle.TUPLE2[0]: sys.getsizeof((0, 0)),
    pickle.TUPLE3[0]: sys.getsizeof((0, 0, 0)),
}


def _metered(op: int, handler: Callable[[Any], None]) -> Callable[[Any], None]:
    cost = 8 + _CONTAINER_OPS.get(op, 0)

    def run(self: _PlainUnpickler) -> None:
        self.spent += cost
        if self.spent > self.budget.memory:
            raise FlightRecorderError(
                f"the pickle builds more than its memory budget ({self.budget.memory:,} bytes "
                f"for a {self.size:,}-byte dump): refused before it is built"
            )
        handler(self)

    return run


class _PlainUnpickler(pickle._Unpickler):
    """Builds dicts, lists, tuples, sets, strings, bytes, numbers, booleans and None; nothing else.

    The pure-Python unpickler (the C one runs opcodes where nothing can count them), each opcode
    metered against the dump's :class:`Budget` before it runs.  About 0.6 s per MB of pickle:
    only PyTorch's timeout dumps are pickles (a capture's answers are JSON), and they are rare."""

    dispatch = {op: _metered(op, fn) for op, fn in pickle._Unpickler.dispatch.items()}

    def __init__(self, data: bytes, budget: Budget) -> None:
        super().__init__(io.BytesIO(data))
        self.size, self.budget, self.spent = len(data), budget, len(data)

    def find_class(self, module: str, name: str) -> Any:
        raise FlightRecorderError(f"the pickle names {module}.{name}: only plain data is read from a dump")


def _unpickle(data: bytes, budget: Budget) -> Any:
    return _PlainUnpickler(data, budget).load()


def check_budget(doc: Any, size: int, budget: Budget) -> None:
    """Walk ``doc`` once, counting every element and character per reference (a cycle or a
    shared list counts as often as it is reached), and stop at the first bound passed:
    :class:`FlightRecorderError`.  A container's items are counted before they are visited, so
    the walk ends within ``budget.elements`` steps; a container of scalars only is read once and
    its counts reused each time it is reached again (a bomb's shared list costs one pass)."""
    elements, text = 1, _text_size(doc)
    todo = [doc] if isinstance(doc, _CONTAINERS) else []
    #: id -> (items, characters) of the scalar-only containers seen (alive: ``doc`` holds them).
    leaves: dict[int, tuple[int, int]] = {}
    while todo:
        node = todo.pop()
        known = leaves.get(id(node))
        if known is not None:
            elements, text = elements + known[0], text + known[1]
        else:
            children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
            elements += len(children)
            if elements > budget.elements:
                break
            chars, nested = 0, False
            for child in children:
                if isinstance(child, str | bytes | bytearray):
                    chars += len(child)
                elif isinstance(child, _CONTAINERS):
                    todo.append(child)
                    nested = True
            text += chars
            if not nested:
                leaves[id(node)] = (len(children), chars)
        if elements > budget.elements:
            break
        if text > budget.text:
            raise FlightRecorderError(
                f"the dump expands beyond its budget: more than {budget.text:,} characters "
                f"of text for {size:,} bytes (references counted each time)"
            )
    if elements > budget.elements:
        raise FlightRecorderError(
            f"the dump expands beyond its budget: more than {budget.elements:,} elements "
            f"for {size:,} bytes (references counted each time)"
        )


_CONTAINERS = (dict, list, tuple, set, frozenset)


def _text_size(value: Any) -> int:
    return len(value) if isinstance(value, str | bytes | bytearray) else 0


@dataclass(frozen=True, slots=True)
class Group:
    """A process group as the dump's ``pg_config`` names it."""

    name: str
    desc: str
    ranks: tuple[int, ...]  # global ranks; () when the dump does not list them


@dataclass(frozen=True, slots=True)
class Entry:
    """One collective or point-to-point operation one rank recorded."""

    record_id: int
    group: str  # the process group's name (a key of pg_config)
    seq: int  # collective_seq_id (collectives) or p2p_seq_id (point-to-point)
    p2p: bool
    op: str  # profiling_name, e.g. "gloo:all_reduce"
    state: str  # one of STATES
    input_sizes: tuple[tuple[int, ...], ...]
    output_sizes: tuple[tuple[int, ...], ...]
    created_ns: int
    completed_ns: int | None
    frames: tuple[str, ...] = ()  # innermost first: "function (file:line)"
    retired: bool = False  # gone from the process group's list of work in flight
    started_ns: int | None = None  # time_discovered_started_ns (NCCL; gloo leaves it 0)

    @property
    def newest_ns(self) -> int:
        """The latest time this entry carries (created, seen started, seen completed): 0 if none."""
        return max(self.created_ns, self.started_ns or 0, self.completed_ns or 0)

    @property
    def completed(self) -> bool:
        # gloo never moves an entry past "scheduled" (measured, torch 2.13): it only retires it.
        return self.state == "completed" or self.retired


@dataclass(frozen=True, slots=True)
class RankDump:
    """One rank's dump."""

    rank: int
    version: str
    groups: Mapping[str, Group]
    entries: tuple[Entry, ...]  # in record order
    source: str  # the file it came from

    def newest_ns(self) -> int:
        """The latest time any entry of this dump carries (0: none): a lower bound of when it was
        taken.  PyTorch writes no dump time of its own, and a file's mtime is lost by a copy."""
        return max((e.newest_ns for e in self.entries), default=0)


_TRAILING_RANK = re.compile(r"^(.*?)(\d+)$")


def _ranks(value: Any) -> tuple[int, ...]:
    """pg_config ranks: a list, or its string form ("[0, 1]"), or "all"/"" when not listed."""
    if isinstance(value, str):
        text = value.strip()
        if not text.startswith("["):
            return ()
        value = ast.literal_eval(text)
    if not isinstance(value, list | tuple) or not all(type(r) is int and r >= 0 for r in value):
        raise FlightRecorderError(f"pg_config ranks {value!r} is not a list of ranks")
    return tuple(int(r) for r in value)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _sizes(value: Any) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, list | tuple):
        return ()
    kept = [s for s in value[:MAX_TENSORS] if isinstance(s, list | tuple)]
    return tuple(tuple(int(d) for d in s[:MAX_DIMS]) for s in kept)


def _frames(value: Any, keep: int) -> tuple[str, ...]:
    out = []
    for f in value if isinstance(value, list) else []:
        if isinstance(f, dict):
            out.append(f"{f.get('name', '?')} ({f.get('filename', '?')}:{f.get('line', '?')})")
        if len(out) >= keep:
            break
    return tuple(out)


def _entry(raw: Any, frames: int) -> Entry:
    if not isinstance(raw, dict):
        raise FlightRecorderError(f"an entry is a {type(raw).__name__}, not a mapping")
    pg = raw.get("process_group")
    group = _text(pg[0]) if isinstance(pg, list | tuple) and pg else str(raw.get("pg_id", ""))
    p2p = raw.get("is_p2p") is True or int(raw.get("collective_seq_id") or 0) == 0
    state = _text(raw.get("state"))
    if state not in STATES:
        raise FlightRecorderError(f"entry state {state!r} is not one of {STATES}")
    completed = raw.get("time_discovered_completed_ns")
    started = raw.get("time_discovered_started_ns")
    return Entry(
        record_id=int(raw.get("record_id", 0)),
        group=group,
        seq=int(raw.get("p2p_seq_id" if p2p else "collective_seq_id") or 0),
        p2p=p2p,
        op=_text(raw.get("profiling_name")),
        state=state,
        input_sizes=_sizes(raw.get("input_sizes")),
        output_sizes=_sizes(raw.get("output_sizes")),
        created_ns=int(raw.get("time_created_ns") or 0),
        completed_ns=int(completed) if isinstance(completed, int) and completed else None,
        frames=_frames(raw.get("frames"), frames),
        retired=raw.get("retired") is True,
        started_ns=int(started) if isinstance(started, int) and started else None,
    )


def parse_dump(data: bytes, rank: int, source: str = "<bytes>", frames: int = 8) -> RankDump:
    """A dump's bytes (pickle or JSON, told apart by content) -> :class:`RankDump`."""
    text = data.lstrip()[:1]
    budget = Budget.of(len(data))
    try:
        doc = json.loads(data) if text in (b"{", b"[") else _unpickle(data, budget)
        check_budget(doc, len(data), budget)
    except FlightRecorderError as exc:
        raise FlightRecorderError(f"{source}: {exc}") from None
    except (ValueError, pickle.UnpicklingError, EOFError, IndexError, KeyError, TypeError, AttributeError,
            OverflowError, RecursionError, MemoryError) as exc:  # fmt: skip
        raise FlightRecorderError(
            f"{source}: not a Flight Recorder dump ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(doc, dict) or "entries" not in doc:
        raise FlightRecorderError(f"{source}: not a Flight Recorder dump (no entries)")
    version = str(doc.get("version", ""))
    if version.split(".")[0] != SUPPORTED_MAJOR:
        raise FlightRecorderError(f"{source}: dump version {version!r} not supported (2.x is)")
    config, raw_entries = doc.get("pg_config") or {}, doc["entries"] or []
    if not isinstance(config, dict) or not isinstance(raw_entries, list):
        raise FlightRecorderError(f"{source}: pg_config must be a mapping and entries a list")
    if len(raw_entries) > MAX_ENTRIES:
        n = len(raw_entries)
        raise FlightRecorderError(f"{source}: {n} entries, more than a dump holds ({MAX_ENTRIES})")
    try:
        groups = {
            str(name): Group(str(name), _text(cfg.get("desc")), _ranks(cfg.get("ranks", "")))
            for name, cfg in config.items()
            if isinstance(cfg, dict)
        }
        entries = tuple(_entry(e, frames) for e in raw_entries)
    except (ValueError, SyntaxError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
        raise FlightRecorderError(f"{source}: malformed dump ({type(exc).__name__}: {exc})") from None
    return RankDump(rank, version, groups, entries, source)


def load_dump_dir(
    directory: Path, prefix: str | None = None, max_bytes: int = 512 << 20
) -> dict[int, RankDump]:
    """Every ``<prefix><rank>`` file of ``directory`` (the prefix inferred when every dump-like
    file shares one), by rank.  Other files (a manifest, hidden files) are left alone."""
    files = [p for p in sorted(directory.iterdir()) if p.is_file() and not p.name.startswith(".")]
    named: dict[str, dict[int, Path]] = {}
    for p in files:
        if prefix is not None:  # given: the rest of the name is the rank (a prefix may end in a digit)
            rest = p.name[len(prefix) :] if p.name.startswith(prefix) else ""
            key, rank_text = (prefix, rest) if rest.isdigit() else ("", "")
        else:
            m = _TRAILING_RANK.match(p.name)
            key, rank_text = (m.group(1), m.group(2)) if m else ("", "")
        if not rank_text:
            continue
        ranks, rank = named.setdefault(key, {}), int(rank_text)
        if rank in ranks:
            raise FlightRecorderError(f"{directory}: two dumps of rank {rank}: {ranks[rank].name}, {p.name}")
        ranks[rank] = p
    if not named:
        raise FlightRecorderError(f"{directory}: no dump files (<prefix><rank>)")
    if len(named) > 1:
        raise FlightRecorderError(
            f"{directory}: dumps with different prefixes {sorted(named)}: name one with --prefix"
        )
    out = {}
    for rank, path in sorted(next(iter(named.values())).items()):
        if path.stat().st_size > max_bytes:
            raise FlightRecorderError(f"{path}: {path.stat().st_size} bytes, over the {max_bytes}-byte limit")
        out[rank] = parse_dump(path.read_bytes(), rank, str(path))
    return out
