"""A tiny job of checkpointing ranks for the checkpoint tests: real torch on CPU, real TCP servers.

Each "machine" is its own folder (its local disk); ranks talk only through their backup servers
on localhost.  A rank is a small Linear model with Adam (so the optimizer has state to save) and a
:class:`DataPosition` (the data position saved with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from trainguard.schemas.config import load_config
from trainguard.training import CheckpointConfig, Checkpointer, DataPosition, ResumableSampler

#: the job's checkpoint key every rank of these tests shares (``TRAINGUARD_CHECKPOINT_KEY``).
JOB_KEY = "ckpt-test-job-key"


@pytest.fixture(autouse=True)
def job_key(monkeypatch: pytest.MonkeyPatch) -> str:
    """Imported by the checkpoint test modules: every rank of a test holds the job's key."""
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_KEY", JOB_KEY)
    return JOB_KEY


@dataclass
class Rank:
    rank: int
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    position: DataPosition
    ckpt: Checkpointer

    def train(self, step: int) -> None:
        torch.manual_seed(step * 100 + self.rank)
        x = torch.randn(4, 8)
        loss = self.model(x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.position.consumed += 4
        self.ckpt.save(step, self.model, self.opt, self.position)


def make_rank(rank: int, machine_dir: Path, layout: dict[str, Any], **cfg: Any) -> Rank:
    torch.manual_seed(rank)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    position = DataPosition(ResumableSampler(64, seed=rank), torch.Generator())
    config = load_config(
        CheckpointConfig,
        {"job": "ckpt-test", "directory": str(machine_dir), "rank": rank, "listen_host": "127.0.0.1",
         "connect_timeout_s": 0.5, "io_timeout_s": 5.0, "restore_wait_s": 1.0, **layout, **cfg},
    )  # fmt: skip
    ckpt = Checkpointer(config)
    ckpt.start()
    return Rank(rank, model, opt, position, ckpt)


def start_job(root: Path, layout: dict[str, Any], **cfg: Any) -> list[Rank]:
    """One rank per machine; every rank connected to every server."""
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1)
    ranks = [make_rank(r, root / f"machine-{r}", layout, **cfg) for r in range(world)]
    addresses = [r.ckpt.address for r in ranks]
    for r in ranks:
        r.ckpt.connect(addresses)
    return ranks


def train_steps(ranks: list[Rank], last: int) -> None:
    """Steps 1..``last`` on every rank, each step's backups sent before the next (none superseded)."""
    for step in range(1, last + 1):
        for r in ranks:
            r.train(step)
        for r in ranks:
            assert r.ckpt.flush(10)


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]
