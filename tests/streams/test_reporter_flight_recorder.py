"""The reporter's side of Flight Recorder captures: registration, PyTorch's variables, answers.

No torch here: a process without an initialised ``torch.distributed`` answers with a reason
(``.error``); the real dump is tested against a gloo job in test_exporter_flight_recorder.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import wait_until
from trainguard.streams import reporter as reporter_module
from trainguard.streams.reporter import FR_POLL_S, Reporter, merge_dumps

TORCH_VARS = (
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_DUMP_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts without the variables the reporter sets (monkeypatch restores them)."""
    for name in (*TORCH_VARS, "TRAINGUARD_FR_DIR", "TRAINGUARD_FLIGHT_RECORDER"):
        monkeypatch.delenv(name, raising=False)


def reporter(tmp_path: Path, rank: int = 3, **kw: Any) -> Reporter:
    return Reporter(
        job="job-fr",
        rank=rank,
        socket_path=str(tmp_path / "reporter.sock"),
        capture_exceptions=False,
        capture_sigterm=False,
        **kw,
    )


def test_registration_appears_and_disappears(tmp_path: Path) -> None:
    rep = reporter(tmp_path)
    fr = tmp_path / "fr"  # beside the socket, where the exporter looks by default
    assert rep.fr_dir == str(fr)
    reg = fr / "ranks" / "3.json"
    assert json.loads(reg.read_text()) == {"rank": 3, "pid": os.getpid(), "job": "job-fr"}
    assert (fr / "timeout").is_dir()
    assert not [p for p in (fr / "ranks").iterdir() if p.name.startswith(".")]  # no temporary left
    rep.close(exit_code=0)
    assert not reg.exists()


def test_torch_variables_set_only_when_unset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rep = reporter(tmp_path)
    prefix = str(tmp_path / "fr" / "timeout" / "rank_")
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "200"
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ  # PyTorch warns it is deprecated
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == prefix
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    rep.close()

    for name in TORCH_VARS:
        monkeypatch.delenv(name, raising=False)
    # The job's own settings win, under either name: PyTorch prefers the new name, so setting it
    # beside a job's old one would override the job.
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/scratch/fr_")
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    rep = reporter(tmp_path / "b")
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ and os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == "/scratch/fr_"
    assert "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in os.environ
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    rep.close()


def test_request_without_torch_distributed_answers_with_a_reason(tmp_path: Path) -> None:
    fr = tmp_path / "fr-dir"
    rep = reporter(tmp_path, fr_dir=str(fr), rank=1)
    (fr / "requests").mkdir()
    (fr / "requests" / "cap-1").write_text("{}")
    t0 = time.monotonic()
    error = fr / "dumps" / "cap-1" / "rank_1.error"
    wait_until(error.exists, 5, f"{error}")
    took = time.monotonic() - t0
    assert took < 1.0 + FR_POLL_S, took
    assert error.read_text() in (
        "torch.distributed is not imported in this process",
        "torch.distributed is not initialized in this process",  # another test imported torch
    )
    assert not (fr / "dumps" / "cap-1" / "rank_1").exists()
    # Answered once: the exporter removes the answer; the reporter does not write it again.
    error.unlink()
    time.sleep(3 * FR_POLL_S)
    assert not error.exists()
    rep.close()


def test_old_requests_hidden_files_and_bad_names_are_ignored(tmp_path: Path) -> None:
    fr = tmp_path / "fr"
    (fr / "requests").mkdir(parents=True)
    old = fr / "requests" / "old-cap"
    old.write_text("{}")
    os.utime(old, (time.time() - 60, time.time() - 60))  # a previous process's leftover
    (fr / "requests" / ".new-cap.123.tmp").write_text("")  # the exporter still writing it
    (fr / "requests" / "bad name").write_text("")
    rep = reporter(tmp_path, rank=0)
    (fr / "requests" / "new-cap").write_text("{}")
    wait_until((fr / "dumps" / "new-cap" / "rank_0.error").exists, 5, "the answer to new-cap")
    assert sorted(p.name for p in (fr / "dumps").iterdir()) == ["new-cap"]
    rep.close()


def test_off_by_argument_or_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rep = reporter(tmp_path / "a", flight_recorder=False)
    assert not (tmp_path / "a" / "fr").exists() and "TORCH_FR_BUFFER_SIZE" not in os.environ
    rep.close()
    monkeypatch.setenv("TRAINGUARD_FLIGHT_RECORDER", "0")
    rep = reporter(tmp_path / "b")
    assert not (tmp_path / "b" / "fr").exists()
    rep.close()
    monkeypatch.setenv("TRAINGUARD_FR_DIR", str(tmp_path / "env-dir"))
    rep = reporter(tmp_path / "c", flight_recorder=True)
    assert (tmp_path / "env-dir" / "ranks" / "3.json").exists()
    rep.close()


def test_unusable_directory_never_stops_training(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the directory should be
    rep = reporter(tmp_path, fr_dir=str(blocker / "fr"))
    rep.step(1, loss=1.0)
    rep.close(exit_code=0)


def test_the_registration_is_kept_fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its modification time is the exporter's liveness check across pid namespaces."""
    monkeypatch.setattr(reporter_module, "FR_REFRESH_S", 0.3)
    rep = reporter(tmp_path)
    reg = tmp_path / "fr" / "ranks" / "3.json"
    old = time.time() - 60
    os.utime(reg, (old, old))
    deadline = time.monotonic() + 5
    while reg.stat().st_mtime < time.time() - 10 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert reg.stat().st_mtime >= time.time() - 10
    rep.close(exit_code=0)


def test_both_recorders_are_merged_into_one_dump() -> None:
    """NCCL groups record in NCCL's own recorder (real H100 dump), gloo groups in the generic one
    (real gloo dump): a rank using both gives one dump with every group and entry, by time."""
    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    nccl = json.loads((fixtures / "flight_recorder_nccl" / "request_json" / "fr_trace_rank_0").read_text())
    gloo = json.loads(
        (fixtures / "flight_recorder" / "tp2pp2dp2_healthy" / "json" / "fr_trace_rank_0").read_text()
    )
    empty = {"version": "2.10", "pg_config": {}, "entries": []}
    merged = merge_dumps([nccl, gloo])
    assert len(merged["entries"]) == len(nccl["entries"]) + len(gloo["entries"])
    created = [e["time_created_ns"] for e in merged["entries"]]
    assert created == sorted(created)
    assert set(merged["pg_config"]) == set(nccl["pg_config"]) | set(gloo["pg_config"])
    assert merge_dumps([nccl, empty]) is nccl and merge_dumps([empty, gloo]) is gloo
