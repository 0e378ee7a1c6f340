"""Every-step checkpoints with a peer backup: save, restore in place, restore on a replacement.

Real torch on CPU, real TCP between the ranks' backup servers on localhost (one thread each).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.streams.ckpt_job import job_key as job_key  # autouse: the ranks hold the job's key
from tests.streams.ckpt_job import make_rank, params, start_job, train_steps
from trainguard.schemas.config import ConfigError, load_config
from trainguard.training import CheckpointConfig

#: TP=2 x DP=2, one rank per machine: rank r's backup rank shares neither its TP nor its DP group.
LAYOUT = {"tp": 2, "dp": 2, "ranks_per_machine": 1}


def test_every_step_shard_and_cross_group_backup(tmp_path: Path) -> None:
    ranks = start_job(tmp_path, LAYOUT)
    try:
        train_steps(ranks, 4)
        for r in ranks:
            assert r.ckpt.flush(10)
        for r in ranks:
            s = r.ckpt.stats()
            assert (s.snapshots, s.written, s.backed_up, s.last_written, s.last_backed_up) == (4, 4, 4, 4, 4)
            assert s.write_failures == s.backup_failures == s.backups_skipped == 0
            # The planning code's peer: the rank differing in both TP and DP coordinates.
            assert r.ckpt.peer_rank == 3 - r.rank
            peer_dir = tmp_path / f"machine-{3 - r.rank}" / "ckpt-test" / f"holder-{3 - r.rank:05d}"
            own_dir = tmp_path / f"machine-{r.rank}" / "ckpt-test" / f"holder-{r.rank:05d}"
            # keep=2: the two newest steps, each a shard plus its manifest, on both machines.
            want = {f"r{r.rank:05d}-s{s:09d}.{ext}" for s in (3, 4) for ext in ("shard", "json")}
            assert {p.name for p in own_dir.glob(f"r{r.rank:05d}-*")} == want
            assert {p.name for p in peer_dir.glob(f"r{r.rank:05d}-*")} == want
    finally:
        for r in ranks:
            r.ckpt.close()


def test_restore_in_place_and_on_a_replacement_from_the_peer(tmp_path: Path) -> None:
    ranks = start_job(tmp_path, LAYOUT)
    try:
        train_steps(ranks, 3)
        for r in ranks:
            r.ckpt.flush(10)
        saved = {r.rank: (params(r.model), r.opt.state_dict()["state"][0]["exp_avg"].clone()) for r in ranks}
        consumed = ranks[1].position.consumed
        # Rank 0 restarts in place (its disk kept); rank 1's machine is evicted and replaced by an
        # empty one: its shard exists only as the backup on rank 2's machine.
        ranks[0].ckpt.close()
        ranks[1].ckpt.close()
        shutil.rmtree(tmp_path / "machine-1")
        fresh = [make_rank(0, tmp_path / "machine-0", LAYOUT), make_rank(1, tmp_path / "replacement", LAYOUT)]
        addresses = [
            fresh[0].ckpt.address,
            fresh[1].ckpt.address,
            ranks[2].ckpt.address,
            ranks[3].ckpt.address,
        ]
        for f in fresh:
            f.ckpt.connect(addresses)
        results = {f.rank: f.ckpt.restore(f.model, f.opt, f.position) for f in fresh}
        assert results[0].step == results[1].step == 3
        assert results[0].source == "local"
        assert results[1].source == ranks[2].ckpt.address  # pulled over TCP from the backup holder
        assert not results[1].fell_back and results[1].reasons == ()
        for f in fresh:
            want_params, want_exp_avg = saved[f.rank]
            assert all(torch.equal(a, b) for a, b in zip(params(f.model), want_params, strict=True))
            assert torch.equal(f.opt.state_dict()["state"][0]["exp_avg"], want_exp_avg)
        assert fresh[1].position.consumed == consumed
        # The replacement trains on and backs up to its peer like any rank.
        fresh[1].train(4)
        assert fresh[1].ckpt.flush(10) and fresh[1].ckpt.stats().backed_up == 1
    finally:
        for r in ranks[2:] + fresh:
            r.ckpt.close()


def test_corrupt_backup_of_an_evicted_rank_falls_back_to_an_older_step(tmp_path: Path) -> None:
    ranks = start_job(tmp_path, LAYOUT, keep=3)
    try:
        train_steps(ranks, 3)
        for r in ranks:
            r.ckpt.flush(10)
        ranks[1].ckpt.close()
        shutil.rmtree(tmp_path / "machine-1")
        # Rank 1's newest backup (on rank 2's machine) rots: one flipped byte.
        backup = tmp_path / "machine-2" / "ckpt-test" / "holder-00002" / "r00001-s000000003.shard"
        raw = bytearray(backup.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        backup.write_bytes(bytes(raw))
        fresh = make_rank(1, tmp_path / "replacement", LAYOUT)
        fresh.ckpt.connect([ranks[0].ckpt.address, fresh.ckpt.address] + [r.ckpt.address for r in ranks[2:]])
        result = fresh.ckpt.restore(fresh.model, fresh.opt, fresh.position)
        assert result.step == 2 and result.newest_seen == 3 and result.fell_back
        assert any("sha256 mismatch" in r for r in result.reasons)
        assert any("step 3: no valid shard or backup of rank(s) 1" in r for r in result.reasons)
        assert fresh.position.consumed == 8  # two steps of 4 samples: step 2's data position
        # Every other rank reads the same inventories, so it picks step 2 as well.
        other = ranks[0].ckpt.restore(ranks[0].model, ranks[0].opt)
        assert other.step == 2 and other.fell_back
    finally:
        for r in [ranks[0], *ranks[2:], fresh]:
            r.ckpt.close()


def test_no_complete_step_says_so(tmp_path: Path) -> None:
    r = make_rank(0, tmp_path / "m0", {"dp": 2, "ranks_per_machine": 1}, restore_wait_s=0.2)
    try:
        r.ckpt.connect([r.ckpt.address, "127.0.0.1:9"])  # rank 1's server is gone for good
        result = r.ckpt.restore(r.model, r.opt)
        assert result.step is None and result.unreachable == ("127.0.0.1:9",)
    finally:
        r.ckpt.close()


def test_interval_and_config_errors(tmp_path: Path) -> None:
    r = make_rank(0, tmp_path / "m0", {}, every=3)
    try:
        for step in range(1, 7):
            r.train(step)
        assert r.ckpt.flush(10)
        s = r.ckpt.stats()
        assert (s.snapshots, s.last_written, s.backed_up) == (2, 6, 0)  # one machine: no backup peer
    finally:
        r.ckpt.close()
    with pytest.raises(ConfigError, match="unknown"):
        load_config(CheckpointConfig, {"job": "j", "directory": "/tmp/x", "evry": 1})
    with pytest.raises(ConfigError):
        load_config(CheckpointConfig, {"job": "j", "directory": "/tmp/x", "keep": 1})
    with pytest.raises(ConfigError, match="when_behind"):
        load_config(CheckpointConfig, {"job": "j", "directory": "/tmp/x", "when_behind": "later"})


def test_connect_gathers_the_addresses_over_torch_distributed(tmp_path: Path) -> None:
    import torch.distributed as dist

    r = make_rank(0, tmp_path / "m0", {})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        assert r.ckpt.connect() == [r.ckpt.address]
    finally:
        dist.destroy_process_group()
        r.ckpt.close()
    with pytest.raises(RuntimeError, match=r"torch\.distributed"):
        r.ckpt.connect()
