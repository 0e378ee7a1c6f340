"""Real NCCL Flight Recorder dumps (``scripts/record_nccl_fr.py`` on an H100: 1-rank NCCL jobs,
since NCCL refuses two ranks of a communicator on one GPU): the format the loader reads -- groups
with their ranks listed, ``completed`` and ``scheduled`` entries, PyTorch's own timeout dump."""

from __future__ import annotations

import json
from pathlib import Path

from trainguard.detectors.flight_recorder import analyze_dumps, load_dump_dir
from trainguard.schemas.topology import JobTopology

NCCL = Path(__file__).resolve().parents[1] / "fixtures" / "flight_recorder_nccl"
MANIFEST = json.loads((NCCL / "manifest.json").read_text())
ONE = JobTopology(job="nccl", tp=1, pp=1, dp=1, ranks_per_machine=1)


def test_a_request_dump_lists_every_group_with_its_ranks() -> None:
    for fmt in ("request_pickle", "request_json"):
        (dump,) = load_dump_dir(NCCL / fmt).values()
        assert dump.version == "2.10"
        assert {g.desc: g.ranks for g in dump.groups.values()} == {
            "default_pg": (0,), "tensor_model_parallel": (0,), "data_parallel": (0,),
        }  # fmt: skip
        assert len(dump.entries) == 81
        assert {e.op for e in dump.entries} == {"nccl:all_reduce", "nccl:all_gather", "nccl:broadcast"}


def test_the_pickle_caught_the_collective_in_flight() -> None:
    (dump,) = load_dump_dir(NCCL / "request_pickle").values()
    last = dump.entries[-1]
    assert (last.op, last.state, last.completed) == ("nccl:all_reduce", "scheduled", False)
    assert all(e.completed for e in dump.entries[:-1])


def test_pytorchs_own_timeout_dump() -> None:
    (dump,) = load_dump_dir(NCCL / "timeout", prefix="rank_").values()
    assert [g.desc for g in dump.groups.values()] == ["default_pg"]
    last = dump.entries[-1]
    assert (last.seq, last.op, last.state, last.completed) == (11, "nccl:all_reduce", "scheduled", False)
    # One rank, in the collective that timed out: no one is missing, the group itself is suspect.
    dumped = {0: MANIFEST["timeout"]["dumped_at_ns"]}
    out = analyze_dumps({0: dump}, ONE, dumped).to_dict()
    assert out["verdict"] == "hang" and out["evidence"]["first_stuck"]["seq"] == 11
    assert out["evidence"]["first_stuck"]["waited_s"] > 5  # the 5 s timeout, and the dump after it
