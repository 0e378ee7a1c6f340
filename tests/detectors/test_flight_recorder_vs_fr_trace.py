"""Issue #41 item 4: our verdicts against PyTorch's own analyzer, ``fr_trace``
(``torch.distributed.flight_recorder``, the ``torchfrtrace`` script), on the same dumps.

``fr_trace`` answers with the ranks missing from the first collective that did not match on every
member of its group; it needs ``pg_config`` to list each group's ranks, which NCCL dumps do and
gloo dumps do not (torch 2.13: one group ``""`` with no ranks), so on the recorded gloo fixtures
it gives no answer (it stops on a group it cannot place) and our verdict stands alone.  Where it
answers, its missing ranks are ours, and our suspects.
"""

from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from trainguard.detectors.flight_recorder import analyze_dumps, load_dump_dir
from trainguard.schemas.topology import JobTopology

pytest.importorskip("torch.distributed.flight_recorder")
from torch.distributed.flight_recorder.components.builder import build_db
from torch.distributed.flight_recorder.components.config_manager import JobConfig
from torch.distributed.flight_recorder.components.loader import read_dir

from tests.detectors.test_flight_recorder_pg_config import TOPO, analyze, entry, tp

ROOT = Path(__file__).resolve().parents[1] / "fixtures"
#: every recorded gloo fixture: the basic set and the Megatron-like one (TP 4, EP, two faults)
RECORDED = sorted(
    p for d in ("flight_recorder", "flight_recorder_megatron") for p in (ROOT / d).iterdir()
    if (p / "manifest.json").exists()
)  # fmt: skip


def fr_trace_missing(directory: Path, prefix: str) -> set[int] | None:
    """``fr_trace``'s answer: the missing ranks of the first collective it could not match on every
    member (``set()``: every collective matched), or ``None`` when it gives no answer."""
    args: argparse.Namespace = JobConfig().parse_args(
        [str(directory), "-p", prefix, "--allow-incomplete-ranks"]
    )
    try:
        details, version = read_dir(args)
        db = build_db(details, args, version)
    except (KeyError, ValueError, AssertionError):
        return None  # a group pg_config does not list (gloo): no answer
    for c in db.collectives:
        if c.missing_ranks:
            return set(c.missing_ranks)
    return set()


def write_pickles(per_rank: dict[int, list[dict[str, object]]], out: Path) -> Path:
    """The hand-made NCCL-format dumps as PyTorch writes them (pickles, every field fr_trace reads)."""
    from tests.detectors.test_flight_recorder_pg_config import PG_CONFIG

    out.mkdir()
    for rank, entries in per_rank.items():
        full = [
            dict(e, frames=[], input_dtypes=["Float"], output_dtypes=["Float"], pg_id=0, op_id=e["record_id"],
                 timeout_ms=600_000, retired=False, thread_id="1", thread_name="main", duration_ms=None)
            for e in entries
        ]  # fmt: skip
        doc = {"version": "2.10", "pg_config": PG_CONFIG, "pg_status": {}, "entries": full}
        (out / f"rank_{rank}").write_bytes(pickle.dumps(doc))
    return out


def _tp4_rank3_missing() -> dict[int, list[dict[str, object]]]:
    return {
        r: [entry(tp(r), 1, True, 0), *([entry(tp(r), 2, False, 5)] if r in (0, 1, 2) else [])]
        for r in range(8)
    }


def _ep_two_missing() -> dict[int, list[dict[str, object]]]:
    per: dict[int, list[dict[str, object]]] = {r: [entry(tp(r), 1, True, 0)] for r in range(8)}
    for r in (0, 2, 4, 6):
        per[r] += [entry("ep_0", 3, True, 1)]
    for r in (0, 4):
        per[r] += [entry("ep_0", 4, False, 2)]
    return per


@pytest.mark.parametrize(
    ("case", "missing"),
    [(_tp4_rank3_missing, {3}), (_ep_two_missing, {2, 6})],
    ids=["tp4_rank3", "ep_ranks_2_6"],
)
def test_where_fr_trace_answers_it_names_our_missing_ranks(
    case: Any, missing: set[int], tmp_path: Path
) -> None:
    per = case()
    theirs = fr_trace_missing(write_pickles(per, tmp_path / "dumps"), "rank_")
    ours = analyze(per)
    assert theirs == missing
    assert set(ours["missing_ranks"]) == theirs and set(ours["suspect_ranks"]) == theirs


def test_a_stuck_group_with_every_member_inside_is_no_missing_rank_for_either(tmp_path: Path) -> None:
    # fr_trace matches the collective on every member (it does not judge states): no missing rank,
    # as ours: no culprit rank.
    per = {r: [entry(tp(r), 1, True, 0), entry(tp(r), 2, False, 5)] for r in range(4)}
    per.update({r: [entry(tp(r), 1, True, 0)] for r in range(4, 8)})
    assert fr_trace_missing(write_pickles(per, tmp_path / "dumps"), "rank_") == set()
    ours = analyze(per)
    assert ours["missing_ranks"] == [] and "no culprit rank" in ours["evidence"]["reason"]


@pytest.mark.parametrize("d", RECORDED, ids=[p.name for p in RECORDED])
def test_recorded_gloo_fixtures_fr_trace_gives_no_answer_ours_is_the_recorded_fault(d: Path) -> None:
    case = d.name
    manifest = json.loads((d / "manifest.json").read_text())
    assert fr_trace_missing(d / "pickle", "fr_trace_rank_") is None  # gloo's pg_config lists no groups
    t = manifest["topology"]
    topo = JobTopology(job=case, tp=t["tp"], pp=t["pp"], dp=t["dp"], ranks_per_machine=t["ranks_per_machine"])
    dumps = load_dump_dir(d / "pickle")
    dump_ns = {int(r): ns for r, ns in manifest["dumped_at_ns"]["pickle"].items()}
    out = analyze_dumps(dumps, topo, dump_ns)
    expected = manifest["expected"]
    assert out.verdict == expected["verdict"]
    if expected["verdict"] == "healthy":
        assert out.suspect_ranks == ()
    else:  # the recorded fault's rank (of two at once: one of them, see test_flight_recorder_megatron)
        assert expected["suspect"] in out.suspect_ranks
        assert set(out.suspect_ranks) <= set(manifest.get("faulty_ranks", [expected["suspect"]]))


def test_topology_of_the_hand_made_dumps_is_not_what_pg_config_says() -> None:
    # The comparison means something only because the command line's groups differ from pg_config's.
    assert next(list(g) for g in TOPO.groups("tp")) == [0, 1]
