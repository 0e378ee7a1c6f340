"""Flight Recorder dumps on the wire: what the exporter ships (parsed, bounded) gives the worker's
analysis the same verdict as the files themselves, on the recorded real gloo dumps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainguard.detectors.flight_recorder import analyze_dumps, dump_to_event, event_to_dump, load_dump_dir
from trainguard.schemas.codec import decode, encode
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.workload import FlightRecorderDump

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "flight_recorder"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "manifest.json").exists())


@pytest.mark.parametrize("name", CASES)
def test_the_wire_form_keeps_the_verdict(name: str) -> None:
    manifest = json.loads((FIXTURES / name / "manifest.json").read_text())
    topology = JobTopology(job=name, **manifest["topology"])
    dumps = load_dump_dir(FIXTURES / name / "pickle")
    dump_ns = {int(r): ns for r, ns in manifest["dumped_at_ns"]["pickle"].items()}
    wire = {}
    for rank, d in dumps.items():
        ev = decode(encode(dump_to_event(d, job=name, node="n1", ts_ms=1, capture_id="c1")))
        assert isinstance(ev, FlightRecorderDump)
        wire[rank] = event_to_dump(ev)
        assert [(e.group, e.seq, e.op, e.state, e.input_sizes, e.retired) for e in wire[rank].entries] == [
            (e.group, e.seq, e.op, e.state, e.input_sizes, e.retired) for e in d.entries
        ]
    a = analyze_dumps(dumps, topology, dump_ns).to_dict()
    b = analyze_dumps(wire, topology, dump_ns).to_dict()
    assert (a["verdict"], a["suspect_ranks"], a["evict"]) == (b["verdict"], b["suspect_ranks"], b["evict"])


def test_only_the_newest_entries_travel() -> None:
    name = CASES[0]
    d = load_dump_dir(FIXTURES / name / "pickle")[0]
    ev = dump_to_event(d, job=name, node="n1", ts_ms=1, max_entries=3)
    assert [e.record_id for e in ev.entries] == [e.record_id for e in d.entries[-3:]]
    assert ev.dropped == len(d.entries) - 3


def test_an_unknown_trigger_is_refused() -> None:
    with pytest.raises(ValueError, match="trigger"):
        FlightRecorderDump(job="j", node="n", rank=0, ts_ms=1, trigger="whenever")


def test_each_group_keeps_its_newest_entries() -> None:
    d = load_dump_dir(FIXTURES / CASES[0] / "pickle")[0]
    groups = {e.group for e in d.entries}
    ev = dump_to_event(d, job="j", node="n1", ts_ms=1, per_group=2)
    kept = [(e.group, e.record_id) for e in ev.entries]
    want = [
        (e.group, e.record_id) for e in d.entries if e in [x for x in d.entries if x.group == e.group][-2:]
    ]
    assert kept == want and {g for g, _ in kept} == groups
    assert ev.dropped == len(d.entries) - len(kept)
