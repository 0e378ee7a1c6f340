"""A tiny real DDP training job (CPU, gloo) that uses the reporter; run by the torch-job test.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TRAINGUARD_JOB, TRAINGUARD_REPORTER_SOCKET.
Trains until killed (or STEPS steps), one step every ~50 ms, with a one-worker DataLoader so each
rank has a dataloader child process for the stack capture to find.
"""

from __future__ import annotations

import os
import time


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, Dataset

    from trainguard.streams.reporter import Reporter

    class Random(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 1_000_000

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            return torch.randn(16, generator=g), torch.randn(1, generator=g)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # 2 * params * batch FLOPs forward, x3 with backward; a made-up 1 GFLOP/s "device" peak.
    rep = Reporter(flops_per_step=6 * 17 * 8, peak_flops=1e9)
    loader = DataLoader(Random(), batch_size=8, num_workers=1)
    steps = int(os.environ.get("STEPS", "100000"))
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        rep.step(step, loss=loss.item(), grad_norm=float(grad_norm), tokens=x.shape[0])
        if step + 1 >= steps:
            break
        time.sleep(0.05)
    rep.close(exit_code=0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
