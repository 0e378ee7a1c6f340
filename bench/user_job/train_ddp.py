"""A training script as a user writes it from the public PyTorch DDP tutorials, protected by TrainGuard.

Written here for ``bench/own_job.py`` (it is not a copy of any public example): plain
``torch.nn.parallel.DistributedDataParallel`` on CPU/gloo, the ``torchrun`` environment variables,
a synthetic regression dataset split by ``DistributedSampler``, and a snapshot (model, optimizer,
epochs run) saved every few epochs by global rank 0 and loaded on start, which is how those
tutorials make a restarted job go on where it stopped.  It knows nothing of TrainGuard beyond the
four lines marked ``# trainguard`` -- exactly the lines ``docs/protect-your-job.md`` tells a user
to add (``tests/bench/test_own_job.py`` checks that they are the guide's lines).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from trainguard.training import Reporter  # trainguard


def dataset(samples: int, features: int) -> TensorDataset:
    """The same synthetic regression data on every rank (a fixed seed): y = x . w + noise."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, features, generator=gen)
    w = torch.randn(features, 1, generator=gen)
    return TensorDataset(x, x @ w + 0.01 * torch.randn(samples, 1, generator=gen))


def model(features: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(features, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--save-every", type=int, default=2, help="epochs between snapshots")
    parser.add_argument("--snapshot", default="snapshot.pt")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--step-sleep", type=float, default=0.05, help="stands in for a GPU's work")
    args = parser.parse_args()

    reporter = Reporter()  # trainguard: before init_process_group
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    net = model(args.features)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    epochs_run = 0
    if os.path.exists(args.snapshot):
        snap = torch.load(args.snapshot, weights_only=True)
        net.load_state_dict(snap["model"])
        opt.load_state_dict(snap["optimizer"])
        epochs_run = snap["epochs_run"]
        print(f"[rank {rank}] resuming from the snapshot at epoch {epochs_run}", flush=True)
    ddp = DDP(net)
    data = dataset(args.samples, args.features)
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(data)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    steps_per_epoch = len(loader)

    for epoch in range(epochs_run, args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(args.step_sleep)
            step = epoch * steps_per_epoch + i + 1
            reporter.step(step, loss=loss.item(), tokens=x.shape[0])  # trainguard
        if rank == 0 and (epoch + 1) % args.save_every == 0:
            tmp = args.snapshot + ".tmp"
            torch.save(
                {"model": net.state_dict(), "optimizer": opt.state_dict(), "epochs_run": epoch + 1},
                tmp,
            )
            os.replace(tmp, args.snapshot)
    dist.destroy_process_group()
    reporter.close(exit_code=0)  # trainguard


if __name__ == "__main__":
    main()
