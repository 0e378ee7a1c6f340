"""A Flight Recorder dump is refused, fast and by name, when it would become much more than it is.

The node exporter parses dumps the training processes left in a directory they can write
(``trainguard.streams.exporter.flight_recorder``): issue #38 found a 57 KB pickle that expands 300
times through its memo, and a dump in ``fr/timeout`` that kills the exporter on every start.  The
budget (``trainguard.detectors.flight_recorder.load.Budget``) refuses both, while PyTorch's own dumps
(``tests/fixtures``) read as before.
"""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import pytest

from trainguard.detectors.flight_recorder import FlightRecorderError, parse_dump
from trainguard.detectors.flight_recorder.load import Budget, check_budget

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def memo_bomb() -> bytes:
    """57 KB of pickle: 4,000 strings, then 390 references to the list of them -- 300 times the
    file in text, 1.6 million elements, once every reference is read."""
    shared = [f"frame_{i:05d}" for i in range(4000)]
    doc = {"version": "2.10", "pg_config": {}, "entries": [{"state": "completed", "frames": [shared] * 390}]}
    return pickle.dumps(doc, protocol=4)


def expansion(data: bytes) -> float:
    """Characters of text in the unpickled document, per reference, per byte of pickle."""
    text, todo = 0, [pickle.loads(data)]  # trusted here: built by this test
    while todo:
        node = todo.pop()
        if isinstance(node, str):
            text += len(node)
        elif isinstance(node, dict):
            todo += [*node.keys(), *node.values()]
        elif isinstance(node, list):
            todo += node
    return text / len(data)


def test_a_57_kb_pickle_expanding_300_times_is_refused_fast() -> None:
    data = memo_bomb()
    assert 55_000 < len(data) < 60_000 and 280 < expansion(data) < 320
    t0 = time.perf_counter()
    with pytest.raises(
        FlightRecorderError,
        match=r"bomb: the dump expands beyond its budget: more than [\d,]+ (elements|characters of text) for 5\d,\d\d\d bytes",
    ):
        parse_dump(data, 0, "bomb")
    took = time.perf_counter() - t0
    assert took < 1.0, f"{took:.3f} s"  # ~0.05 s measured; the bound leaves room for a busy CI


def test_a_pickle_that_builds_too_much_is_refused_before_it_is_built() -> None:
    """One byte per 216-byte empty set: 57 KB would be 12 MB of sets."""
    data = b"\x80\x04](" + b"\x8f" * 57_000 + b"e."
    with pytest.raises(
        FlightRecorderError, match=r"more than its memory budget .* refused before it is built"
    ):
        parse_dump(data, 0, "sets")


def test_a_cycle_is_refused_not_walked_forever() -> None:
    loop: list[object] = []
    loop.append(loop)
    doc = {"version": "2.10", "entries": [], "pg_config": {"x": loop}}
    with pytest.raises(FlightRecorderError, match="expands beyond its budget"):
        parse_dump(pickle.dumps(doc), 0, "cycle")


def test_a_claimed_length_beyond_the_file_is_an_error() -> None:
    """BINBYTES8 claiming a terabyte: the C unpickler allocates what a length claims; this one reads."""
    data = b"\x80\x04\x8e" + (1 << 40).to_bytes(8, "little") + b"xx."
    with pytest.raises(FlightRecorderError, match="not a Flight Recorder dump"):
        parse_dump(data, 0, "claim")


#: one dump of each recorded job and format (the rest of each directory is alike).
_SAMPLES = sorted(
    {
        p.parent: p for p in sorted(FIXTURES.glob("flight_recorder*/**/*"), reverse=True) if "rank" in p.name
    }.values()
)


@pytest.mark.parametrize("path", _SAMPLES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_pytorchs_own_dumps_are_well_inside_the_budget(path: Path) -> None:
    data = path.read_bytes()
    dump = parse_dump(data, 0, str(path))
    assert dump.entries
    doc = json.loads(data) if data[:1] == b"{" else pickle.loads(data)  # trusted fixtures
    small = Budget.of(len(data))
    quarter = Budget(small.elements // 4, small.text // 4, small.memory // 4)
    check_budget(doc, len(data), quarter)  # a quarter of the budget is enough
