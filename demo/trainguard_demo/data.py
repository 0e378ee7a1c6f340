"""The training data: windows of the generated corpus, shuffled, read by a real DataLoader.

Sample ``i`` is the corpus window starting near ``i * seq_len`` (a random shift of up to
``seq_len // 2`` characters: augmentation drawn in the loader's workers).  Each DP replica reads
its share of a shuffled epoch (:class:`trainguard.streams.data_position.ResumableSampler`), the draws are
seeded per sample (:class:`trainguard.streams.data_position.SeededSamples`), and the position -- epoch,
samples consumed -- is saved in every checkpoint, so a restarted job reads exactly the batches
it would have read (``tests/demo/test_data_path.py`` checks it by hash per step).

The batches come from :class:`trainguard.streams.shadow_loader.ShadowLoader` (a worker set with a warm
standby; TrainGuard's job) or from one plain ``DataLoader`` (``--no-shadow-loader``: the
baseline).  A worker is where the ``hang-dataloader`` fault blocks: the first worker that reads a
sample after the fault is injected hangs (and marks the fault fired, so a standby's workers and
restarted ranks read on).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from trainguard.streams.data_position import DataPosition, SeededSamples
from trainguard_demo.corpus import corpus_text, encode
from trainguard_demo.faults import FaultPoller, hang_forever


class CorpusWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Item ``i``: ``(inputs, targets)`` of ``seq_len`` tokens, a window near ``i * seq_len``."""

    def __init__(self, seq_len: int, faults: FaultPoller | None = None) -> None:
        self.tokens = torch.tensor(encode(corpus_text()), dtype=torch.long)
        self.seq_len = seq_len
        self.shift = max(1, seq_len // 2)
        self.faults = faults
        self.count = (len(self.tokens) - seq_len - 1 - self.shift) // seq_len

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.faults is not None:
            self.faults.poll()
            if self.faults.active_now("hang-dataloader"):
                hang_forever("dataloader")
        start = i * self.seq_len + int(torch.randint(0, self.shift, ()))
        window = self.tokens[start : start + self.seq_len + 1]
        return window[:-1], window[1:]


def collate_numpy(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[np.ndarray, np.ndarray]:
    """A batch as two numpy arrays (the training loop makes them tensors, without a copy).

    A batch of tensors crosses from a worker by passing a file descriptor per tensor, which needs
    the worker's sharing thread to run: on this 2-core host at nice 10 the loop then waited
    35 ms (median, p90 63 ms) for a batch its worker had ready; small numpy arrays are pickled
    inline: 3 ms (measured with three busy processes beside the loader, 60 steps)."""
    return np.stack([x.numpy() for x, _ in items]), np.stack([y.numpy() for _, y in items])


#: DataLoader arguments of both paths besides the batch size and workers: an epoch's last,
#: partial batch is dropped (the pipeline splits a batch into equal micro-batches).
LOADER_ARGS: dict[str, Any] = {"drop_last": True, "prefetch_factor": 2, "collate_fn": collate_numpy}


def plain_batches(data: CorpusWindows, position: DataPosition, rows: int, workers: int) -> Any:
    """Batches of ``rows`` samples from one DataLoader of ``workers`` processes (no standby)."""
    seeded: Any = SeededSamples(data)  # a map-style dataset by protocol, not a torch Dataset subclass
    loader: DataLoader[Any] = DataLoader(
        seeded, batch_size=rows, sampler=position.sampler, num_workers=workers,
        generator=position.generator, **LOADER_ARGS,
    )  # fmt: skip
    return position.batches(loader)
