"""Exact resume on a real 2-worker DataLoader: a job stopped and restarted from its checkpoint
(each part a fresh process) trains on the same batches, hash for hash, as one that never stopped,
across epoch boundaries -- and without the per-sample seeding it would not (the check is live)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainguard.streams.data_position import DataPosition, ResumableSampler, SeededSamples

pytest.importorskip("torch")

#: Whole training jobs in fresh processes, each loading torch: minutes on a busy host, not the
#: quick tier (docs/testing.md).
pytestmark = pytest.mark.integration

JOB = Path(__file__).with_name("exact_resume_job.py")
ROOT = Path(__file__).resolve().parents[2]
STEPS = 14  # 6 steps per epoch: epochs 0, 1 and the start of 2


def _start(out: Path, *args: str) -> tuple[Path, subprocess.Popen[bytes]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(JOB), str(out), *args]
    return out, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _results(*runs: tuple[Path, subprocess.Popen[bytes]]) -> list[dict[str, Any]]:
    """Wait for runs started in parallel (each loads torch: seconds on a busy host)."""
    out = []
    for path, proc in runs:
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, log.decode(errors="replace")[-3000:]
        out.append(json.loads(path.read_text()))
    return out


@pytest.mark.timeout(900)  # seven processes that each load torch and start two workers
def test_restarted_job_reads_the_same_batches(tmp_path: Path) -> None:
    t = tmp_path
    ck6, ck9 = str(t / "6.pt"), str(t / "9.pt")
    full, raw_full, part1, raw1 = _results(
        _start(t / "full.json", "--steps", str(STEPS)),
        _start(t / "raw_full.json", "--steps", str(STEPS), "--unseeded"),
        # stopped at the end of epoch 0 ...
        _start(t / "p1.json", "--steps", str(STEPS), "--stop-after", "6", "--ckpt", ck6),
        _start(
            t / "raw1.json", "--steps", str(STEPS), "--stop-after", "9", "--ckpt", ck9 + ".raw", "--unseeded"
        ),
    )
    # ... then in the middle of epoch 1 ...
    part2, raw2 = _results(
        _start(t / "p2.json", "--steps", str(STEPS), "--resume", ck6, "--stop-after", "9", "--ckpt", ck9),
        _start(t / "raw2.json", "--steps", str(STEPS), "--resume", ck9 + ".raw", "--unseeded"),
    )
    # ... and on to epoch 2.
    (part3,) = _results(_start(t / "p3.json", "--steps", str(STEPS), "--resume", ck9))

    resumed = part1["hashes"] + part2["hashes"] + part3["hashes"]
    assert len(full["hashes"]) == STEPS
    assert resumed == full["hashes"]
    assert part1["indices"] + part2["indices"] + part3["indices"] == full["indices"]
    assert part3["weights"] == full["weights"]  # the model trained on exactly the same data
    assert part3["consumed"] == full["consumed"] == 22 + 22 + 8
    # Every sample once per epoch, a different order each epoch.
    epochs = [[i for batch in full["indices"][e * 6 : e * 6 + 6] for i in batch] for e in (0, 1)]
    assert [sorted(e) for e in epochs] == [list(range(22))] * 2 and epochs[0] != epochs[1]
    # Without the per-sample seeding the same indices come back (the sampler resumed), but the
    # workers' augmentation draws do not: fresh workers restart their RNG streams.
    assert raw1["indices"] + raw2["indices"] == raw_full["indices"]
    assert raw1["hashes"] == raw_full["hashes"][:9]
    assert raw2["hashes"] != raw_full["hashes"][9:]


class _Loader:
    """What DataPosition reads of a DataLoader, iterating the sampler in-process."""

    def __init__(self, sampler: ResumableSampler, batch_size: int) -> None:
        self.sampler, self.batch_size, self.dataset = sampler, batch_size, SeededSamples(list(range(10)))

    def __iter__(self) -> Iterator[list[int]]:
        idx = list(self.sampler)
        return iter(idx[i : i + self.batch_size] for i in range(0, len(idx), self.batch_size))


def test_position_counts_what_the_loop_consumed_and_refuses_another_order() -> None:
    s = ResumableSampler(10, seed=3, rank=1, world_size=2)
    pos = DataPosition(s)
    it = pos.batches(_Loader(s, 2))
    taken = [next(it) for _ in range(4)]  # epoch 0 holds 5 of rank 1's samples: 2 + 2 + 1, then epoch 1
    assert [len(b) for b in taken] == [2, 2, 1, 2]
    state = pos.state_dict()
    assert (state["epoch"], state["offset"], state["consumed"]) == (1, 2, 7)
    assert [i for batch in taken[:3] for i in batch] == s.order(0) and taken[3] == s.order(1)[:2]
    assert set(s.order(0)).isdisjoint(ResumableSampler(10, seed=3, rank=0, world_size=2).order(0))

    other = DataPosition(ResumableSampler(10, seed=4, rank=1, world_size=2))
    with pytest.raises(ValueError, match="seed: saved 3, now 4"):
        other.load_state_dict(state)
    again = DataPosition(ResumableSampler(10, seed=3, rank=1, world_size=2))
    again.load_state_dict(state)
    assert next(again.batches(_Loader(again.sampler, 2))) == s.order(1)[2:4]


def test_seeded_samples_draw_per_index_and_leave_the_callers_rng_alone() -> None:
    import random

    class Draws:
        def __len__(self) -> int:
            return 5

        def __getitem__(self, i: int) -> tuple[int, float]:
            return i, random.random()

    ds = SeededSamples(Draws())
    ds.epoch_seed = 11
    random.seed(99)
    expected_next = random.Random(99).random()
    forward = [ds[i] for i in range(5)]
    assert [ds[i] for i in reversed(range(5))] == forward[::-1]  # the order read does not matter
    assert random.random() == expected_next  # the training process's own stream went on untouched
    ds.epoch_seed = 12
    assert [ds[i] for i in range(5)] != forward  # another epoch, other draws
