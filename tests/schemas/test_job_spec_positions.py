"""JobSpec version 2 carries machine positions; version 1 records (recorded incidents, older
producers) still decode, as specs whose positions are not known."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainguard.infra.clickhouse.rows import MAPS
from trainguard.schemas.codec import DecodeError, decode, encode
from trainguard.schemas.control import JobSpec
from trainguard.schemas.network import MachinePosition
from trainguard.schemas.topology import JobTopology

INCIDENTS = Path(__file__).resolve().parent.parent / "fixtures" / "incidents"


def _spec(**positions: MachinePosition) -> JobSpec:
    topo = JobTopology(job="j", dp=2, ranks_per_machine=1, machines=["n1", "n2"])
    return JobSpec(job="j", ts_ms=1, topology=topo, standbys=["s1"], positions=dict(positions))


def test_positions_survive_the_wire_and_the_version_says_so() -> None:
    spec = _spec(n1=MachinePosition("pod-1", "r3"), s1=MachinePosition("pod-2"))
    raw = encode(spec)
    assert json.loads(raw)["version"] == 2
    assert decode(raw) == spec


def test_version_1_specs_from_recorded_incidents_still_decode() -> None:
    seen = 0
    for path in sorted(INCIDENTS.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            value = json.loads(line)["value"]
            if '"schema":"job_spec"' in value:
                assert json.loads(value)["version"] == 1
                spec = decode(value.encode())
                assert isinstance(spec, JobSpec) and spec.positions == {}
                seen += 1
    assert seen >= 10


def test_a_bad_position_is_a_decode_error() -> None:
    body = json.loads(encode(_spec()))
    body["positions"] = {"n1": {"pod": "p", "row": 4}}
    with pytest.raises(DecodeError, match=r"job_spec\.positions\.n1: unknown field\(s\) 'row'"):
        decode(json.dumps(body).encode())
    body["positions"] = {"n1": {"pod": "p" * 300}}
    with pytest.raises(DecodeError, match="exceeds 256"):
        decode(json.dumps(body).encode())


def test_positions_are_stored_in_the_spec_json_not_a_column_of_their_own() -> None:
    spec = _spec(n1=MachinePosition("pod-1", "r3"))
    (row,) = MAPS[JobSpec].rows(spec)
    assert "positions" not in row
    assert json.loads(row["spec_json"])["positions"] == {"n1": {"pod": "pod-1", "rack": "r3"}}
