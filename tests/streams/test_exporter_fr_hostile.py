"""A tenant who writes the Flight Recorder directory cannot make the exporter touch anything else,
nor kill it (issue #38).  Fast: a temporary directory, no broker.

What a rank's user can put in ``fr/``: a link in place of ``dumps/``, ``dumps/<capture>``,
``requests/``, ``timeout/``, ``timeout/bad`` or a dump; a hard link to someone else's file; a
pickle bomb.  Each test puts one there and checks the target ("the victim", standing in for the
exporter's spool) is untouched and the collector still works.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest

from trainguard.schemas.base import Event
from trainguard.schemas.workload import FlightRecorderDump
from trainguard.streams.exporter import flight_recorder as fr_module
from trainguard.streams.exporter.config import FlightRecorderConfig
from trainguard.streams.exporter.flight_recorder import MAX_QUARANTINED, STALE_S, FlightRecorderCollector

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "flight_recorder"
DUMP = (FIXTURES / "tp2pp2dp2_compute_hang" / "pickle" / "fr_trace_rank_3").read_bytes()


class Published(list[FlightRecorderDump]):
    def __call__(self, event: Event) -> None:
        assert isinstance(event, FlightRecorderDump)
        self.append(event)


def collector(fr: Path, published: Published) -> FlightRecorderCollector:
    cfg = FlightRecorderConfig(
        dir=str(fr), wait_s=0.3, timeout_poll_s=0.05, settle_s=0.0, registration_fresh_s=0.0
    )
    return FlightRecorderCollector(cfg, "node-fr", "job-fr", list, published)


def victim(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A directory outside ``fr/`` holding old files and a subdirectory (a spool, say)."""
    v = tmp_path / "spool"
    (v / "sub").mkdir(parents=True)
    files = {"0000.seg": b"segment", "sub/0001.seg": b"another", "rank_0": DUMP}
    for name, data in files.items():
        (v / name).write_bytes(data)
    old = time.time() - STALE_S - 60
    for p in [v, v / "sub", *(v / n for n in files)]:
        os.utime(p, (old, old), follow_symlinks=False)
    return v, files


def intact(v: Path, files: dict[str, bytes]) -> bool:
    return all((v / n).read_bytes() == data for n, data in files.items())


def register(fr: Path, rank: int) -> None:
    (fr / "ranks").mkdir(parents=True, exist_ok=True)
    (fr / "ranks" / f"{rank}.json").write_text(
        json.dumps({"rank": rank, "pid": os.getpid(), "job": "job-fr"})
    )


def test_a_linked_dumps_directory_is_never_swept(tmp_path: Path) -> None:
    fr, (v, files) = tmp_path / "fr", victim(tmp_path)
    fr.mkdir()
    (fr / "dumps").symlink_to(v)
    (fr / "requests").symlink_to(v)
    col = collector(fr, Published())
    col.sweep_stale()
    assert intact(v, files)
    assert not (fr / "dumps").exists() and not (fr / "requests").is_symlink()  # the links went
    assert col.errors == 2 and "not followed" in col.last_error


def test_links_inside_dumps_are_removed_as_links(tmp_path: Path) -> None:
    fr, (v, files) = tmp_path / "fr", victim(tmp_path)
    (fr / "dumps").mkdir(parents=True)
    (fr / "dumps" / "old-cap").symlink_to(v)
    (fr / "dumps" / "old-file").symlink_to(v / "0000.seg")
    real = fr / "dumps" / "real-old"
    (real / "inner").mkdir(parents=True)
    (real / "inner" / "to-victim").symlink_to(v)
    old = time.time() - STALE_S - 60
    for p in (fr / "dumps" / "old-cap", fr / "dumps" / "old-file", real):
        os.utime(p, (old, old), follow_symlinks=False)
    collector(fr, Published()).sweep_stale()
    assert intact(v, files)
    assert list((fr / "dumps").iterdir()) == []


def test_a_capture_never_reads_or_deletes_through_a_linked_answer_directory(tmp_path: Path) -> None:
    fr, (v, files) = tmp_path / "fr", victim(tmp_path)
    register(fr, 0)
    (fr / "dumps").mkdir()
    (fr / "dumps" / "cap-1").symlink_to(v)  # holds "rank_0": a dump the rank did not write here
    published = Published()
    col = collector(fr, published)
    col.capture("cap-1")
    assert intact(v, files)
    assert not os.path.lexists(fr / "dumps" / "cap-1") and not os.path.lexists(fr / "requests" / "cap-1")
    (ev,) = published
    assert ev.rank == 0 and ev.entries == [] and "no Flight Recorder dump within" in ev.error
    assert col.errors == 2  # the link refused, then the rank silent


def test_a_capture_writes_no_request_through_a_linked_requests_directory(tmp_path: Path) -> None:
    fr, (v, files) = tmp_path / "fr", victim(tmp_path)
    register(fr, 0)
    (fr / "requests").symlink_to(v)
    published = Published()
    col = collector(fr, published)
    col.capture("cap-2")  # its sweep removes the link first: the request goes to a real directory
    assert intact(v, files) and sorted(p.name for p in v.iterdir()) == ["0000.seg", "rank_0", "sub"]
    assert (fr / "requests").is_dir() and not (fr / "requests").is_symlink()
    (fr / "requests").rmdir()
    (fr / "requests").symlink_to(v)  # a link made right after the sweep: the request is refused
    col.sweep_stale = lambda: None  # type: ignore[method-assign]
    col.capture("cap-3")
    assert intact(v, files) and sorted(p.name for p in v.iterdir()) == ["0000.seg", "rank_0", "sub"]
    assert "Flight Recorder request failed" in published[-1].error and "not followed" in published[-1].error


def test_timeout_links_are_not_followed(tmp_path: Path) -> None:
    fr, (v, files) = tmp_path / "fr", victim(tmp_path)
    fr.mkdir()
    (fr / "timeout").symlink_to(v)  # holds rank_0
    published = Published()
    col = collector(fr, published)
    assert col.scan_timeouts() == 0 and not published and intact(v, files)
    (fr / "timeout").unlink()
    (fr / "timeout").mkdir()
    (fr / "timeout" / "rank_1").symlink_to(v / "rank_0")
    (fr / "timeout" / "bad").symlink_to(v)  # the quarantine taken over
    shutil.copy(FIXTURES / "tp2pp2dp2_compute_hang" / "pickle" / "fr_trace_rank_2", fr / "timeout" / "rank_2")
    assert col.scan_timeouts() == 1 and [e.rank for e in published] == [2] and intact(v, files)
    assert (fr / "timeout" / "rank_1").is_symlink()  # a link is no dump: left alone
    bad = fr / "timeout" / "bad"
    assert bad.is_dir() and not bad.is_symlink() and (bad.stat().st_mode & 0o777) == 0o700


def test_a_hard_link_to_another_file_is_not_read(tmp_path: Path) -> None:
    fr, (v, files) = tmp_path / "fr", victim(tmp_path)
    (fr / "timeout").mkdir(parents=True)
    os.link(v / "rank_0", fr / "timeout" / "rank_0")
    published = Published()
    assert collector(fr, published).scan_timeouts() == 1
    (ev,) = published
    assert "2 links" in ev.error and ev.entries == []
    assert intact(v, files)


def test_a_pickle_bomb_is_refused_quarantined_and_not_taken_again(tmp_path: Path) -> None:
    fr = tmp_path / "fr"
    (fr / "timeout").mkdir(parents=True)
    shared = [f"frame_{i:05d}" for i in range(4000)]
    bomb = pickle.dumps({"version": "2.10", "entries": [{"state": "completed", "frames": [shared] * 390}]})
    (fr / "timeout" / "rank_5").write_bytes(bomb)
    published = Published()
    t0 = time.perf_counter()
    assert collector(fr, published).scan_timeouts() == 1
    assert time.perf_counter() - t0 < 1.0
    (ev,) = published
    assert "expands beyond its budget" in ev.error
    (kept,) = (fr / "timeout" / "bad").iterdir()
    assert kept.name.startswith("rank_5.") and kept.read_bytes() == bomb
    again = Published()
    assert collector(fr, again).scan_timeouts() == 0 and not again


class _Killed(BaseException):
    """Stands in for the process dying in the middle of a parse (out of memory, a signal)."""


def test_a_dump_whose_parse_kills_the_exporter_is_not_taken_on_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fr = tmp_path / "fr"
    (fr / "timeout").mkdir(parents=True)
    (fr / "timeout" / "rank_0").write_bytes(DUMP)

    def die(*args: object, **kw: object) -> None:
        raise _Killed

    with monkeypatch.context() as m:
        m.setattr(fr_module, "parse_dump", die)
        with pytest.raises(_Killed):
            collector(fr, Published()).scan_timeouts()
    # The next exporter: the dump is in quarantine, not in timeout/ -- no crash loop.
    published = Published()
    assert collector(fr, published).scan_timeouts() == 0 and not published
    assert [p.name for p in (fr / "timeout").iterdir()] == ["bad"]
    (kept,) = (fr / "timeout" / "bad").iterdir()
    assert kept.read_bytes() == DUMP


def test_the_quarantine_keeps_the_newest_only(tmp_path: Path) -> None:
    fr = tmp_path / "fr"
    (fr / "timeout").mkdir(parents=True)
    col = collector(fr, Published())
    for i in range(MAX_QUARANTINED + 4):
        (fr / "timeout" / f"rank_{i}").write_bytes(b"garbage")
        col.scan_timeouts()
    assert len(list((fr / "timeout" / "bad").iterdir())) == MAX_QUARANTINED
    assert col.errors == MAX_QUARANTINED + 4  # each one unreadable, each one said
