"""The training data: random windows of the generated corpus, one batch per (step, DP replica).

A batch depends only on ``(seed, step, dp index)``, so a job resumed at step ``s`` sees exactly
the batches it would have seen, with no sampler state in the checkpoint.  Batches come through a
real ``DataLoader`` with one worker process (torch names it ``pt_data_worker``), which is where
the ``hang-dataloader`` fault blocks.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

from trainguard_demo.corpus import corpus_text, encode
from trainguard_demo.faults import FaultPoller, hang_forever


class StepBatches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Item ``step``: ``(inputs, targets)`` of shape ``(rows, seq_len)`` for one DP replica."""

    def __init__(self, rows: int, seq_len: int, seed: int, dp_index: int, faults: FaultPoller | None) -> None:
        self.tokens = torch.tensor(encode(corpus_text()), dtype=torch.long)
        self.rows, self.seq_len, self.seed, self.dp_index = rows, seq_len, seed, dp_index
        self.faults = faults

    def __len__(self) -> int:
        return 1 << 40  # steps are unbounded; the sampler decides which ones are read

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.faults is not None:
            self.faults.poll()
            if self.faults.active("hang-dataloader", step):
                hang_forever("dataloader")
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + self.dp_index)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.rows,), generator=g)
        x = torch.stack([self.tokens[s : s + self.seq_len] for s in starts.tolist()])
        y = torch.stack([self.tokens[s + 1 : s + 1 + self.seq_len] for s in starts.tolist()])
        return x, y


def make_loader(data: StepBatches, start: int, stop: int) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
    """Batches for steps ``start .. stop-1`` from one worker process, two steps prefetched."""
    return DataLoader(data, batch_size=None, sampler=range(start, stop), num_workers=1, prefetch_factor=2)
