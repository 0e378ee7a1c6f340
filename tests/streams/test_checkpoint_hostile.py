"""Bad input to the checkpointer: hostile peers, forged manifests, torn shards, dead peers, bad disks.

None of it may crash the training rank or be lost silently: each is refused with a reason,
counted, or skipped for an older complete step.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.streams.ckpt_job import JOB_KEY, make_rank, start_job
from tests.streams.ckpt_job import job_key as job_key  # autouse: the ranks hold the job's key
from trainguard.streams.checkpoint.store import Manifest
from trainguard.streams.checkpoint.transport import TransportError, fetch_shard, split_address

LAYOUT = {"dp": 2, "ranks_per_machine": 1}
KEY = hashlib.sha256(JOB_KEY.encode()).digest()  # what the job's ranks sign with


def raw_request(address: str, header: Any, payload: bytes = b"") -> dict[str, Any]:
    """One request as a hostile peer would send it, bypassing the client's checks."""
    body = json.dumps(header).encode()
    with socket.create_connection(split_address(address), timeout=5) as s:
        s.sendall(struct.pack(">I", len(body)) + body + payload)
        (n,) = struct.unpack(">I", s.recv(4))
        return json.loads(s.recv(n))


def manifest(data: bytes, key: bytes = KEY, **over: Any) -> dict[str, Any]:
    m = Manifest("ckpt-test", 5, 1, 2, len(data), hashlib.sha256(data).hexdigest()).signed(key).to_dict()
    return {**m, **over}


@pytest.fixture
def server(tmp_path: Path):
    r = make_rank(0, tmp_path / "m0", LAYOUT)
    yield r
    r.ckpt.close()


@pytest.mark.parametrize(
    "header",
    [
        {"op": "put", "manifest": manifest(b"x" * 10, job="../../../etc")},
        {"op": "put", "manifest": manifest(b"x" * 10, rank="../../x")},
        {"op": "put", "manifest": manifest(b"x" * 10, step=-1)},
        {"op": "put", "manifest": {**manifest(b"x" * 10), "name": "../../evil.pt"}},
        {"op": "put", "manifest": manifest(b"x" * 10, job="other-job")},
        {"op": "get", "job": "ckpt-test", "step": "../1", "rank": 0},
        {"op": "list", "job": "/etc"},
        {"op": "rm -rf"},
        ["not", "an", "object"],
    ],
)
def test_hostile_requests_are_refused_and_write_nothing(server, tmp_path: Path, header: Any) -> None:
    reply = raw_request(server.ckpt.address, header, b"x" * 10)
    assert reply["ok"] is False and reply["error"]
    assert server.ckpt.stats().server_refused == 1
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files == []  # nothing written, inside the store or outside it


def test_forged_or_truncated_backup_is_refused(server, tmp_path: Path) -> None:
    data = b"real shard bytes"
    # A key holder's manifest for other bytes: the bytes are refused.
    forged = (
        Manifest("ckpt-test", 5, 1, 2, len(data), hashlib.sha256(b"other").hexdigest()).signed(KEY).to_dict()
    )
    assert raw_request(server.ckpt.address, {"op": "put", "manifest": forged}, data)["error"].startswith(
        "sha256 mismatch"
    )
    # The peer promises 16 bytes and hangs up after 4: a torn backup is never renamed into place.
    body = json.dumps({"op": "put", "manifest": manifest(data)}).encode()
    with socket.create_connection(split_address(server.ckpt.address), timeout=5) as s:
        s.sendall(struct.pack(">I", len(body)) + body + data[:4])
        s.shutdown(socket.SHUT_WR)
        assert b"truncated" in s.recv(4096)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    assert server.ckpt.stats().server_refused == 2


def test_a_torn_local_shard_is_passed_over(tmp_path: Path) -> None:
    ranks = start_job(tmp_path, LAYOUT)
    try:
        for step in (1, 2):
            for r in ranks:
                r.train(step)
        for r in ranks:
            r.ckpt.flush(10)
        # Rank 0's own step-2 shard is truncated, and the backup of it on rank 1's machine lost.
        own = tmp_path / "machine-0" / "ckpt-test" / "holder-00000" / "r00000-s000000002.shard"
        own.write_bytes(own.read_bytes()[:100])
        (tmp_path / "machine-1" / "ckpt-test" / "holder-00001" / "r00000-s000000002.json").unlink()
        result = ranks[0].ckpt.restore(ranks[0].model, ranks[0].opt)
        assert result.step == 1 and result.fell_back
        assert any("truncated" in r for r in result.reasons)
        # A client asking a peer for a shard it holds only torn gets an error, never the bytes.
        with pytest.raises(TransportError, match="no valid local copy"):
            fetch_shard(ranks[0].ckpt.address, "ckpt-test", 2, 0, connect_s=1, io_s=5)
    finally:
        for r in ranks:
            r.ckpt.close()


def test_unreachable_peer_never_stops_training(tmp_path: Path) -> None:
    r = make_rank(0, tmp_path / "m0", LAYOUT, peer_retry_s=60)
    try:
        r.ckpt.connect([r.ckpt.address, "127.0.0.1:9"])  # the peer's machine is gone
        for step in range(1, 5):
            r.train(step)  # would raise here if a failure leaked into the loop
        assert r.ckpt.flush(10)
        s = r.ckpt.stats()
        assert (s.written, s.backed_up, s.backup_failures, s.backups_skipped) == (4, 0, 1, 3)
        assert "127.0.0.1:9 unreachable" in s.last_error
    finally:
        r.ckpt.close()


def test_a_failing_disk_is_counted_and_the_backup_still_sent(tmp_path: Path) -> None:
    ranks = start_job(tmp_path, LAYOUT)
    try:
        # Rank 0's checkpoint folder becomes unusable (here: a file where the folder was).
        shutil.rmtree(ranks[0].ckpt.store.dir)
        ranks[0].ckpt.store.dir.write_text("not a folder")
        for step in (1, 2):
            ranks[0].train(step)
        assert ranks[0].ckpt.flush(10)
        s = ranks[0].ckpt.stats()
        assert (s.written, s.write_failures, s.backed_up) == (0, 2, 2)
        assert "local shard of step 2" in s.last_error
    finally:
        for r in ranks:
            r.ckpt.close()


@pytest.mark.parametrize(
    "node",
    [
        {"t": "load", "shape": [1], "at": 0, "n": 4},  # a torch attribute that is not a dtype
        {"t": "float32", "shape": [1000], "at": 0, "n": 4000},  # runs past the shard's bytes
        {"t": "float32", "shape": [2], "at": 0, "n": 4},  # size does not match the shape
        {"d": [[{"l": []}, {"v": 1}]]},  # an unhashable dict key
        {"v": {"__reduce__": "os.system"}},  # a value that is not a plain scalar
    ],
)
def test_a_malformed_shard_is_refused_on_decode(node: Any) -> None:
    import torch

    from trainguard.streams.checkpoint.state import MAGIC, decode, encode

    snapshot = {"model": {"w": torch.ones(1)}}  # the parts are views into it: it must stay alive
    good = b"".join(encode(snapshot, torch.Tensor))
    assert torch.equal(decode(good)["model"]["w"], torch.ones(1))
    meta = json.dumps({"d": [[{"v": "model"}, node]]}).encode()
    with pytest.raises(ValueError):
        decode(MAGIC + struct.pack(">Q", len(meta)) + meta + b"\0" * 4)


def test_a_peer_that_never_answers_delays_no_step(tmp_path: Path) -> None:
    # A peer whose kernel accepts the connection but whose process never reads or replies: the
    # backup waits for io_timeout_s in the sender thread, never in the loop.
    with socket.socket() as black_hole:
        black_hole.bind(("127.0.0.1", 0))
        black_hole.listen(8)
        hole = f"127.0.0.1:{black_hole.getsockname()[1]}"
        r = make_rank(0, tmp_path / "m0", LAYOUT, io_timeout_s=2.0, peer_retry_s=60)
        try:
            r.ckpt.connect([r.ckpt.address, hole])
            t0 = time.monotonic()
            for step in range(1, 5):
                r.train(step)
            assert time.monotonic() - t0 < 1.5 and r.ckpt.stats().blocked_s < 0.5
            assert r.ckpt.flush(10)
            s = r.ckpt.stats()
            # Every shard is on the local disk; of the backups, one timed out and the rest were
            # superseded or fell in the retry pause: each accounted for, none silently lost.
            assert (s.snapshots, s.written, s.backed_up, s.backup_failures, s.backups_skipped) == (
                4,
                4,
                0,
                1,
                3,
            )
            assert "timed out" in s.last_error
        finally:
            r.ckpt.close()


def test_skip_leaves_out_steps_while_the_disk_is_behind(tmp_path: Path) -> None:
    r = make_rank(0, tmp_path / "m0", {}, when_behind="skip")
    disk_free = threading.Event()
    put = r.ckpt.store.put

    def slow_put(*args: Any, **kwargs: Any) -> Any:  # a disk that stalls until released
        disk_free.wait(10)
        return put(*args, **kwargs)

    r.ckpt.store.put = slow_put  # type: ignore[method-assign]
    try:
        for step in range(1, 5):
            r.train(step)  # steps 1 and 2 fill both buffers; 3 and 4 find the writer behind
        s = r.ckpt.stats()
        assert (s.snapshots, s.skipped_busy) == (2, 2) and s.blocked_s < 0.5
        disk_free.set()
        assert r.ckpt.flush(10)
        assert (r.ckpt.stats().written, r.ckpt.stats().last_written) == (2, 2)
    finally:
        disk_free.set()
        r.ckpt.close()


def test_a_backup_forged_without_the_jobs_key_is_refused_before_it_is_stored(server, tmp_path: Path) -> None:
    """Anyone who reaches a backup port can compute a sha256; only the job's ranks hold its key."""
    data = b"poisoned weights"
    for forged in (manifest(data, key=b"not-the-job-key"), manifest(data, mac="")):
        reply = raw_request(server.ckpt.address, {"op": "put", "manifest": forged}, data)
        assert reply["ok"] is False and "mac does not verify" in reply["error"]
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_a_shard_planted_on_disk_without_the_key_is_never_restored(tmp_path: Path) -> None:
    ranks = start_job(tmp_path, LAYOUT)
    try:
        ranks[0].train(1)
        for r in ranks:
            r.ckpt.flush()
        store = ranks[0].ckpt.store
        good, _ = store.inventory()
        newest = max(m.step for m in good)
        # A forger with write access to the folder but not the key plants a newer step.
        plant = Manifest("ckpt-test", newest + 5, 0, 2, 4, hashlib.sha256(b"evil").hexdigest()).signed(b"x")
        base = store.dir / f"r{0:05d}-s{newest + 5:09d}"
        base.with_suffix(".shard").write_bytes(b"evil")
        base.with_suffix(".json").write_text(json.dumps(plant.to_dict()))
        good, bad = store.inventory()
        assert newest + 5 not in {m.step for m in good}
        assert any("mac does not verify" in b for b in bad)
    finally:
        for r in ranks:
            r.ckpt.close()


def test_a_job_without_its_key_is_a_setup_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAINGUARD_CHECKPOINT_KEY")
    with pytest.raises(ValueError, match="TRAINGUARD_CHECKPOINT_KEY"):
        make_rank(0, tmp_path / "m0", LAYOUT)
    r = make_rank(0, tmp_path / "m1", {**LAYOUT, "require_key": False})  # a trusted network, said so
    try:
        assert r.ckpt.store.key == b""
    finally:
        r.ckpt.close()
