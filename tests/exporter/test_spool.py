"""The on-disk spool: order, bound, torn tails, restart, partial-delivery rewrite."""

from __future__ import annotations

from pathlib import Path

from streams.exporter.spool import Record, Spool, encode_frame


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
