"""A tiny training job for the exact-resume test: a real multi-worker DataLoader over a dataset
whose items draw random augmentation in the workers, a model, a checkpoint with the data position.

``python exact_resume_job.py OUT --steps N [--stop-after K --ckpt PATH] [--resume PATH]
[--unseeded]`` writes ``{"hashes": [...], "indices": [[...], ...], "weights": ...}`` to OUT:
one hash per step of the batch the step trained on."""

from __future__ import annotations

import argparse
import hashlib
import json
import random

import torch
from torch.utils.data import DataLoader, Dataset

from trainguard.streams.data_position import DataPosition, ResumableSampler, SeededSamples

DATASET_LEN = 22  # 6 batches of 4 per epoch, the last one of 2
BATCH = 4


class Augmented(Dataset[torch.Tensor]):
    """Item i: its index and two random draws (Python's and torch's RNG, as augmentation uses)."""

    def __len__(self) -> int:
        return DATASET_LEN

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), random.random(), float(torch.rand(()))], dtype=torch.float64)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--stop-after", type=int, default=0)
    p.add_argument("--ckpt", default="")
    p.add_argument("--resume", default="")
    p.add_argument("--unseeded", action="store_true")
    a = p.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = ResumableSampler(DATASET_LEN, seed=1234)
    gen = torch.Generator()
    ds = Augmented() if a.unseeded else SeededSamples(Augmented())
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=2, generator=gen)
    position = DataPosition(sampler, gen)
    step = 0
    if a.resume:
        ckpt = torch.load(a.resume, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        position.load_state_dict(ckpt["data_position"])
        step = ckpt["step"]

    hashes, indices = [], []
    for batch in position.batches(loader):
        loss = model(batch).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        hashes.append(hashlib.sha256(batch.numpy().tobytes()).hexdigest())
        indices.append([int(v) for v in batch[:, 0].tolist()])
        if step == a.stop_after:
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
            torch.save({**state, "data_position": position.state_dict()}, a.ckpt)
            break
        if step == a.steps:
            break
    weights = [float(v) for v in torch.cat([t.flatten() for t in model.state_dict().values()])]
    with open(a.out, "w") as fh:
        json.dump(
            {"hashes": hashes, "indices": indices, "weights": weights, "consumed": position.consumed}, fh
        )


if __name__ == "__main__":
    main()
