"""Fast tests of the demo workload's pieces that need no process group: spec, corpus, code
versions, fault files, checkpoint completeness and backup placement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from trainguard_demo import codever
from trainguard_demo.checkpoint import CheckpointWriter, backup_machine, latest_complete, load_shard
from trainguard_demo.config import LaunchSpec
from trainguard_demo.faults import FaultPoller, clear_faults, inject_fault, read_faults
from trainguard_demo.faults import main as faults_main
from trainguard_demo.trainer import build_parser, spec_from_args

from trainguard.detectors.planning import _shares_group


def test_argv_round_trip() -> None:
    spec = LaunchSpec(
        job="j",
        cluster_dir="/c",
        tp=2,
        pp=2,
        dp=2,
        ranks_per_machine=2,
        machines=["a", "b", "c", "d"],
        steps=7,
        master_port=29699,
        resume=False,
        reporter_socket="/s.sock",
    )
    for rank in range(8):
        back, r = spec_from_args(build_parser().parse_args(spec.to_argv(rank)))
        assert (back, r) == (spec, rank)


def test_argv_checks_machine_and_world_size() -> None:
    argv = LaunchSpec(job="j", cluster_dir="/c", tp=2, pp=1, dp=1, machines=["a", "b"]).to_argv(1)
    with pytest.raises(SystemExit, match="rank 1 is on b"):
        spec_from_args(build_parser().parse_args([*argv, "--machine", "a"]))
    with pytest.raises(SystemExit, match="world-size 3"):
        spec_from_args(build_parser().parse_args([*argv, "--world-size", "3"]))


def test_backup_machine_shares_no_group_and_replacement_keeps_mapping() -> None:
    spec = LaunchSpec(job="j", cluster_dir="/c", tp=2, pp=2, dp=2, ranks_per_machine=2)
    topo = spec.topology()
    for m in spec.machine_names():
        peer = backup_machine(spec, m)
        assert peer is not None and peer != m
        for r in spec.ranks_on(m):
            for q in spec.ranks_on(peer):
                assert not _shares_group(topo, r, q)
    swapped = spec.replace_machine("machine-1", "standby-0")
    assert backup_machine(swapped, "standby-0") == backup_machine(spec, "machine-1")
    # One real parallel dimension: no cross-group peer exists, the neighbour holds the backup.
    assert backup_machine(LaunchSpec(job="j", cluster_dir="/c", pp=2), "machine-0") == "machine-1"


def test_code_version_switch_and_rollback(tmp_path: Path) -> None:
    watcher = codever.CodeWatcher(tmp_path)
    assert watcher.version == "v1" and not watcher.poll()
    inject_fault(tmp_path, "any", "user-error")
    assert watcher.poll() and watcher.version == "v2-buggy"
    with pytest.raises(TypeError, match="approximate"):
        watcher.module.activation(torch.ones(2))
    assert codever.rollback(tmp_path) == "v1"
    assert watcher.poll() and watcher.version == "v1"
    assert watcher.module.activation(torch.zeros(1)).item() == 0.0
    with pytest.raises(ValueError, match="unknown code version"):
        codever.set_version(tmp_path, "v9")


def test_fault_polling_one_shot_and_persistent(tmp_path: Path) -> None:
    one = inject_fault(tmp_path, "m0", "crash", at_step=3)
    keep = inject_fault(tmp_path, "m0", "slow", local_rank=None, factor=3, persistent=True)
    other_rank = inject_fault(tmp_path, "m0", "nan", local_rank=1)
    assert [f.id for f in read_faults(tmp_path, "m0")] == [one.id, keep.id, other_rank.id]
    p = FaultPoller(tmp_path, "m0", "t", rank=0, local_rank=0)
    p.poll()
    assert p.active("crash", 2) is None and p.active("crash", 3) == one
    assert p.active("crash", 4) == one  # stays active in the process that fired it
    assert p.active("nan", 9) is None  # meant for local rank 1
    assert p.active("slow", 1) == keep
    # A restarted process of the same rank: the one-shot crash is spent, the slow machine is not.
    again = FaultPoller(tmp_path, "m0", "t", rank=0, local_rank=0)
    again.poll()
    assert again.active("crash", 5) is None and again.active("slow", 5) == keep
    clear_faults(tmp_path, "m0")
    again.poll()
    assert again.active("slow", 6) is None


def test_faults_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    faults_main(
        [
            "--cluster-dir",
            str(tmp_path),
            "--machine",
            "m1",
            "--fault",
            "hang",
            "--local-rank",
            "all",
            "--at-step",
            "4",
        ]
    )
    printed = json.loads(capsys.readouterr().out)
    (f,) = read_faults(tmp_path, "m1")
    assert printed["id"] == f.id and f.local_rank is None and f.at_step == 4
    faults_main(["--cluster-dir", str(tmp_path), "--machine", "m1", "--clear"])
    assert read_faults(tmp_path, "m1") == []


def _write_all(spec: LaunchSpec, step: int, ranks: range | list[int]) -> None:
    for r in ranks:
        w = CheckpointWriter(spec, r)
        w.submit(step, {"w": torch.full((3,), float(step)), "step": step})
        w.wait()


def test_latest_complete_needs_every_rank_and_uses_backups(tmp_path: Path) -> None:
    spec = LaunchSpec(job="j", cluster_dir=str(tmp_path), tp=1, pp=2, dp=2, keep_checkpoints=5)
    _write_all(spec, 1, range(4))
    _write_all(spec, 2, [0, 1, 2])  # rank 3's write of step 2 never finished
    found = latest_complete(spec)
    assert found is not None and found[0] == 1
    # A torn shard (manifest present, bytes cut) does not count.
    _write_all(spec, 2, [3])
    own = spec.paths().ckpt_step("machine-3", "j", 2) / "rank-00003.pt"
    own.write_bytes(own.read_bytes()[:10])
    found = latest_complete(spec)
    assert found is not None and found[0] == 2 and all(len(f) == 1 for f in [found[1][3]])
    assert "backup" in found[1][3][0].parts
    # Machine 3 evicted, a standby takes its rank: its shards come from the backup peer.
    swapped = spec.replace_machine("machine-3", "standby-0")
    found = latest_complete(swapped)
    assert found is not None and found[0] == 2
    state = load_shard(found[1][3])
    assert state["step"] == 2 and "backup" in state["loaded_from"]
    assert latest_complete(swapped, at_most=1) is not None


def test_writer_prunes_old_steps(tmp_path: Path) -> None:
    spec = LaunchSpec(job="j", cluster_dir=str(tmp_path), tp=2, pp=2, keep_checkpoints=2)
    w = CheckpointWriter(spec, 0)
    for step in range(1, 6):
        w.submit(step, {"step": step})
    w.wait()
    own = sorted(p.name for p in spec.paths().ckpt_root("machine-0", "j").glob("step-*"))
    assert own == ["step-00000004", "step-00000005"]
    assert w.last_written == 5
