"""``trainguard fr analyze`` on a recorded gloo capture (a rank hung in compute, 16 ranks)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from click.testing import CliRunner

from trainguard.commands.fr import fr

CASE = Path(__file__).resolve().parents[1] / "fixtures" / "flight_recorder" / "tp2pp2dp4_compute_hang"
TOPOLOGY = ["--tp", "2", "--pp", "2", "--dp", "4", "--ranks-per-machine", "2"]


def _dumped_at() -> str:
    manifest = json.loads((CASE / "manifest.json").read_text())
    return str(max(manifest["dumped_at_ns"]["pickle"].values()) / 1e9)  # a checkout does not keep file times


def test_fr_analyze_names_the_hung_rank_and_its_pipeline() -> None:
    args = ["analyze", str(CASE / "pickle"), *TOPOLOGY, "--dumped-at", _dumped_at(), "--json"]
    res = CliRunner().invoke(fr, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["verdict"] == "hang" and out["suspect_ranks"] == [13]
    evict = {"kind": "pp", "ranks": [5, 13], "machines": [2, 6], "why": "", "not_evicted": None}
    assert out["evict"] == evict  # 2 of the job's 8 machines: the pipeline goes
    text = CliRunner().invoke(fr, ["analyze", str(CASE / "json"), *TOPOLOGY, "--dumped-at", _dumped_at()])
    assert "verdict: hang" in text.output and "evict: pp group [5, 13] on machines [2, 6]" in text.output


def test_fr_analyze_refuses_a_pickle_that_names_code(tmp_path: Path) -> None:
    (tmp_path / "fr_trace_rank_0").write_bytes(pickle.dumps({"entries": [print], "version": "2.10"}))
    res = CliRunner().invoke(fr, ["analyze", str(tmp_path), *TOPOLOGY])
    assert res.exit_code == 1 and "only plain data is read" in res.output


def test_fr_analyze_times_the_dumps_by_their_entries_not_by_file_times(tmp_path: Path) -> None:
    """Issue #41: a copy's mtime (here: a year later) said "none completed it in 37,181,420 s".
    Without --dumped-at the dump time is the dumps' newest entry; the verdict stays the recorded one."""
    import os
    import shutil

    copy = tmp_path / "dumps"
    shutil.copytree(CASE / "pickle", copy)
    manifest = json.loads((CASE / "manifest.json").read_text())
    later = max(manifest["dumped_at_ns"]["pickle"].values()) + 365 * 86_400 * 10**9
    for f in copy.iterdir():
        os.utime(f, ns=(later, later))
    res = CliRunner().invoke(fr, ["analyze", str(copy), *TOPOLOGY, "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["verdict"] == "hang" and out["suspect_ranks"] == [manifest["expected"]["suspect"]]
    when = out["evidence"]["dump_time"]
    assert when["from"] == "newest entry"
    # The newest entry precedes the real dump by the seconds the job hung (6 s of --stuck-s), not a year.
    lag_s = (max(manifest["dumped_at_ns"]["pickle"].values()) - when["ns"]) / 1e9
    assert 0 <= lag_s < 30
    assert all(s["waited_s"] < 30 for s in out["evidence"]["stuck"])
    text = CliRunner().invoke(fr, ["analyze", str(copy), *TOPOLOGY]).output
    assert "from the newest entry (a lower bound" in text
