"""The on-disk spool: order, bound, torn tails, restart, partial-delivery rewrite, fsync policy."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from trainguard.streams.exporter.config import load_exporter_config
from trainguard.streams.exporter.spool import Record, Spool, encode_frame

#: (what was synced: "file"/"dir", its size then, the calling thread's name)
Sync = tuple[str, int, str]


def _drain(sp: Spool) -> list[bytes]:
    out = []
    sp.seal()
    while (path := sp.oldest()) is not None:
        out += [r.value for r in sp.read(path)]
        sp.remove(path)
    return out


def test_oldest_first_across_segments(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=200)
    for i in range(50):
        sp.append(Record("t", b"k", f"v{i}".encode()))
    assert len(list(tmp_path.glob("*.seg"))) > 3
    assert sp.pending_records == 50
    assert _drain(sp) == [f"v{i}".encode() for i in range(50)]
    assert sp.pending_records == 0 and sp.dropped_records == 0


def test_bound_drops_oldest_and_counts(tmp_path: Path) -> None:
    frame = len(encode_frame(Record("t", b"k", b"x" * 100)))
    sp = Spool(tmp_path, max_bytes=frame * 10, segment_bytes=frame * 2)
    for i in range(30):
        sp.append(Record("t", b"k", f"{i:03d}".encode() + b"x" * 97))
    kept = _drain(sp)
    assert sp.dropped_records == 30 - len(kept) > 0
    assert [int(v[:3]) for v in kept] == list(range(30 - len(kept), 30))  # the newest survive
    assert sp.pending_records == 0 and sp.total_bytes_locked() == 0


def test_restart_keeps_records_and_ignores_torn_tail(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20)
    for i in range(5):
        sp.append(Record("topic.a", None, f"v{i}".encode()))
    # crash: no seal/close; then a torn half-frame at the end of the file
    (seg,) = tmp_path.glob("*.seg")
    with open(seg, "ab") as fh:
        fh.write(encode_frame(Record("topic.a", None, b"torn"))[:-2])
    again = Spool(tmp_path, max_bytes=1 << 20)
    assert again.pending_records == 5
    again.append(Record("topic.b", b"key", b"after"))
    path = again.oldest()
    assert path is not None
    recs = again.read(path)
    assert [r.value for r in recs] == [b"v0", b"v1", b"v2", b"v3", b"v4"] and recs[0].key is None
    # delivery gave up half way: only the unacknowledged records stay
    again.rewrite(path, recs[3:])
    assert _drain(again) == [b"v3", b"v4", b"after"]


# -- durability ---------------------------------------------------------------------------------
@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Sync]]:
    """Every ``os.fsync`` (still performed), with what it covered: the size is the proof that the
    records appended so far were in the synced file."""
    calls: list[Sync] = []
    real = os.fsync

    def spy(fd: int) -> None:
        st = os.fstat(fd)
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
        calls.append((kind, st.st_size, threading.current_thread().name))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    yield calls


def _rec(i: int) -> Record:
    return Record("t", b"k", f"v{i}".encode())


def _frames(n: int) -> int:
    return sum(len(encode_frame(_rec(i))) for i in range(n))


def _files(calls: list[Sync]) -> list[int]:
    return [size for kind, size, _ in calls if kind == "file"]


def _kinds(calls: list[Sync]) -> list[str]:
    return [kind for kind, _, _ in calls]


def _wait_for(cond: Callable[[], object], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_seal_fsyncs_segment_and_its_directory_entry(tmp_path: Path, fsyncs: list[Sync]) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20, fsync_interval_s=3600)
    for i in range(3):
        sp.append(_rec(i))
    assert fsyncs == []  # the interval has not passed: appends do not sync
    sp.seal()
    assert _files(fsyncs) == [_frames(3)]
    assert _kinds(fsyncs).count("dir") == 1  # the new segment's name
    sp.close()


def test_full_segment_is_sealed_with_fsync(tmp_path: Path, fsyncs: list[Sync]) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=_frames(4), fsync_interval_s=3600)
    for i in range(8):
        sp.append(_rec(i))
    assert len(_files(fsyncs)) == 2 and sp.pending_records == 8
    sp.close()


def test_interval_fsync_runs_in_background_once_per_batch(tmp_path: Path, fsyncs: list[Sync]) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20, fsync_interval_s=0.05)
    for i in range(5):
        sp.append(_rec(i))
    # (a slow machine may have synced a part first; the directory entry follows the first sync)
    _wait_for(lambda: _files(fsyncs)[-1:] == [_frames(5)] and "dir" in _kinds(fsyncs))
    assert _files(fsyncs)[-1:] == [_frames(5)]
    assert {t for _, _, t in fsyncs} == {"spool-fsync"}  # appends never waited for it
    synced = len(fsyncs)
    time.sleep(0.2)  # idle ticks: nothing new, no fsync
    assert len(fsyncs) == synced
    sp.append(_rec(5))
    _wait_for(lambda: len(fsyncs) > synced)
    assert fsyncs[synced:] == [("file", _frames(6), "spool-fsync")]
    sp.close()
    assert sp._flusher is not None and not sp._flusher.is_alive()


def test_interval_zero_fsyncs_every_append(tmp_path: Path, fsyncs: list[Sync]) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20, fsync_interval_s=0)
    me = threading.current_thread().name
    for i in range(4):
        sp.append(_rec(i))
        assert _files(fsyncs)[-1] == _frames(i + 1)  # durable before append() returned
    assert _files(fsyncs) == [_frames(n) for n in range(1, 5)]
    assert {t for _, _, t in fsyncs} == {me}
    sp.close()


def test_none_never_fsyncs(tmp_path: Path, fsyncs: list[Sync]) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20, fsync_interval_s=None)
    for i in range(3):
        sp.append(_rec(i))
    sp.seal()
    path = sp.oldest()
    assert path is not None
    sp.rewrite(path, sp.read(path)[1:])
    sp.close()
    assert fsyncs == [] and _drain(Spool(tmp_path, max_bytes=1 << 20, fsync_interval_s=None)) == [
        b"v1",
        b"v2",
    ]


def test_synced_records_survive_reopening(tmp_path: Path, fsyncs: list[Sync]) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20, fsync_interval_s=3600)
    for i in range(3):
        sp.append(_rec(i))
    sp.sync()
    assert _files(fsyncs) == [_frames(3)]
    # crash: no seal, no close; a new process finds everything that was synced
    again = Spool(tmp_path, max_bytes=1 << 20, fsync_interval_s=3600)
    assert again.pending_records == 3
    assert _drain(again) == [b"v0", b"v1", b"v2"]
    again.close()


def test_rewrite_fsyncs_temp_file_then_directory(
    tmp_path: Path, fsyncs: list[Sync], monkeypatch: pytest.MonkeyPatch
) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20, fsync_interval_s=3600)
    for i in range(4):
        sp.append(_rec(i))
    sp.seal()
    path = sp.oldest()
    assert path is not None
    fsyncs.clear()
    order: list[str] = []
    real_replace = os.replace

    def replace(src: str, dst: str) -> None:
        order.append(f"replace after {_kinds(fsyncs)}")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    sp.rewrite(path, sp.read(path)[2:])
    # the new content is on disk before its name replaces the old file, the rename after
    assert _kinds(fsyncs) == ["file", "dir"] and fsyncs[0][1] == path.stat().st_size
    assert order == ["replace after ['file']"]
    assert _drain(sp) == [b"v2", b"v3"]
    sp.close()


def test_rewrite_is_atomic_when_crashing_before_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20, fsync_interval_s=3600)
    for i in range(4):
        sp.append(_rec(i))
    sp.seal()
    path = sp.oldest()
    assert path is not None
    before = path.read_bytes()

    def crash(src: object, dst: object) -> None:
        raise OSError("node went down")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="node went down"):
        sp.rewrite(path, sp.read(path)[3:])
    monkeypatch.undo()
    assert path.read_bytes() == before  # the old segment, whole
    assert len(list(tmp_path.glob("*.tmp"))) == 1  # the half-done rewrite
    again = Spool(tmp_path, max_bytes=1 << 20, fsync_interval_s=3600)
    assert list(tmp_path.glob("*.tmp")) == []  # cleaned up on start
    assert _drain(again) == [b"v0", b"v1", b"v2", b"v3"]  # re-sent: consumers deduplicate
    again.close()
    sp.close()


def test_fsync_interval_config() -> None:
    assert load_exporter_config(None, environ={}).delivery.spool_fsync_interval_s == 1.0
    env = {"TRAINGUARD_EXPORTER__DELIVERY__SPOOL_FSYNC_INTERVAL_S": "0"}
    assert load_exporter_config(None, environ=env).delivery.spool_fsync_interval_s == 0
    with pytest.raises(ValueError, match="below the minimum"):
        load_exporter_config({"delivery": {"spool_fsync_interval_s": -1}}, environ={})
    with pytest.raises(ValueError, match="unknown"):
        load_exporter_config({"delivery": {"spool_fsync_interval": 1}}, environ={})
