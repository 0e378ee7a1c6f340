"""Exact resume of a training job's data stream: the data position saved with the model.

A job restarted from a checkpoint should read, batch for batch, the samples it would have read
had it never stopped: not the start of the epoch again (samples seen twice), not a fresh shuffle
(samples never seen), not fresh augmentation draws.  Three pieces do it with a standard
``torch.utils.data.DataLoader`` (``num_workers`` >= 0, ``sampler=``):

* :class:`ResumableSampler` -- a deterministic permutation per (seed, epoch), optionally this
  rank's share of it, starting at ``offset``: the samples of the epoch already consumed;
* :class:`SeededSamples` -- a dataset wrapper that seeds ``random``, ``torch`` and ``numpy``
  before each item from (the epoch's seed, the index), so random augmentation in the loader's
  workers depends on the sample, not on which worker fetched it or how many it fetched before
  (a resumed epoch's workers start fresh, so their RNG streams would otherwise differ);
* :class:`DataPosition` -- the training loop's side: iterates the loader epoch after epoch,
  counts what the loop *consumed* (the sampler cannot: the loader prefetches ahead of the loop),
  seeds the loader's ``generator`` per epoch (so each epoch's worker ``base_seed`` is reproduced
  too) and gives the ``state_dict()`` to save in the checkpoint.

Typical use (the training script's checkpoint hook saves ``position.state_dict()`` beside the
model, and loads it before iterating)::

    sampler = ResumableSampler(len(ds), seed=1234, rank=dp_rank, world_size=dp_size)
    gen = torch.Generator()
    loader = DataLoader(SeededSamples(ds), batch_size=8, sampler=sampler, num_workers=2, generator=gen)
    position = DataPosition(sampler, gen)
    if ckpt is not None:
        position.load_state_dict(ckpt["data_position"])
    for batch in position.batches(loader):
        ...
        save({"model": ..., "data_position": position.state_dict()})

The loader must not use ``persistent_workers`` (workers made once would keep the first epoch's
seeds), and its ``batch_size`` must be set (the consumed count advances by it).  Torch is never
imported here: the generator is passed in, and :class:`SeededSamples` finds torch (and numpy)
in ``sys.modules`` -- a process that runs a DataLoader has imported it.

>>> s = ResumableSampler(10, seed=7)
>>> first = list(s)
>>> s.load_state_dict({**s.state_dict(), "offset": 4})
>>> list(s) == first[4:], sorted(first) == list(range(10))
(True, True)
"""

from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Iterator
from typing import Any

#: the state_dict's format; a checkpoint of another version is refused, not misread.
STATE_VERSION = 1


def mix(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes and Python versions, unlike hash()).

    >>> mix(1, 2) == mix(1, 2), mix(1, 2) != mix(2, 1)
    (True, True)
    """
    raw = b"".join(int(p).to_bytes(16, "little", signed=True) for p in parts)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1


class ResumableSampler:
    """Indices of a dataset of ``dataset_len`` items: epoch ``epoch``'s order from ``offset`` on.

    With ``shuffle``, the order is a permutation seeded by (``seed``, ``epoch``), the same in every
    process; without, ``0 .. dataset_len-1``.  With ``world_size`` > 1, this rank takes every
    ``world_size``-th index of the order from ``rank`` on (the tail that does not divide evenly is
    dropped, so every rank has as many samples per epoch).  ``offset`` counts this rank's samples.
    """

    def __init__(
        self, dataset_len: int, *, seed: int = 0, shuffle: bool = True, rank: int = 0, world_size: int = 1
    ) -> None:
        if dataset_len < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad sampler: dataset_len={dataset_len}, rank={rank}, world_size={world_size}")
        if dataset_len < world_size:
            raise ValueError(f"{dataset_len} samples cannot be split over {world_size} ranks")
        self.dataset_len, self.seed, self.shuffle = dataset_len, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.offset = 0

    @property
    def per_epoch(self) -> int:
        """This rank's samples per epoch."""
        return self.dataset_len // self.world_size

    def order(self, epoch: int) -> list[int]:
        """This rank's indices of ``epoch``, in order (the whole epoch, ignoring ``offset``)."""
        indices = list(range(self.dataset_len))
        if self.shuffle:
            random.Random(mix(self.seed, epoch)).shuffle(indices)
        return indices[: self.per_epoch * self.world_size][self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        # The slice is taken now, not lazily: the loader calls iter() before the loop consumes
        # anything, and ``offset`` moves while the epoch is read.
        return iter(self.order(self.epoch)[self.offset :])

    def __len__(self) -> int:
        return self.per_epoch - self.offset

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first sample."""
        self.epoch, self.offset = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "dataset_len": self.dataset_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "rank": self.rank,
            "world_size": self.world_size,
            "epoch": self.epoch,
            "offset": self.offset,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved epoch and offset.  A different dataset, seed, shuffle or sharding
        would make the saved offset point into another order: refused rather than resumed wrongly."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data position version {state.get('version')!r}, expected {STATE_VERSION}")
        mine = self.state_dict()
        changed = [
            k for k in ("dataset_len", "seed", "shuffle", "rank", "world_size") if state.get(k) != mine[k]
        ]
        if changed:
            diff = ", ".join(f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in changed)
            raise ValueError(f"the checkpoint's data position is for another sample order ({diff})")
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset <= self.per_epoch:
            raise ValueError(f"bad data position: epoch {epoch}, offset {offset} of {self.per_epoch}")
        self.epoch, self.offset = epoch, offset


class SeededSamples:
    """A map-style dataset whose item ``i`` is drawn with ``random``, ``torch`` and (if imported)
    ``numpy`` seeded from (``epoch_seed``, ``i``): reproducible wherever and whenever it is read.
    Item ``(s, i)`` is item ``i`` drawn with ``epoch_seed`` ``s``.

    :class:`DataPosition` sets ``epoch_seed`` before each epoch's workers start (they get a copy
    of the dataset then).  Seeding costs a few microseconds per item (without workers, saving
    and restoring the training process's RNG states a little more)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.epoch_seed = 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int | tuple[int, int]) -> Any:
        # A key may carry its epoch's seed, ``(epoch_seed, index)``: the shadow loader's samplers
        # do, so workers started epochs ago (persistent ones) draw what fresh ones would.
        epoch_seed, index = key if isinstance(key, tuple) else (self.epoch_seed, key)
        seed = mix(epoch_seed, index)
        torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
        data = sys.modules.get("torch.utils.data")
        if data is not None and data.get_worker_info() is not None:
            _seed_all(seed, torch, np)  # a loader worker: its RNGs serve the items only
            return self.dataset[index]
        # In the training process itself (``num_workers=0``): its RNGs also drive the model
        # (dropout, ...), which loading must not reseed, so they are put back after the item.
        saved = (random.getstate(), torch and torch.get_rng_state(), np and np.random.get_state())
        try:
            _seed_all(seed, torch, np)
            return self.dataset[index]
        finally:
            random.setstate(saved[0])
            if torch is not None:
                torch.set_rng_state(saved[1])
            if np is not None:
                np.random.set_state(saved[2])


def _seed_all(seed: int, torch: Any, np: Any) -> None:
    random.seed(seed)
    if torch is not None:
        torch.manual_seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)


class DataPosition:
    """The training loop's data position: which epoch, how many of its samples were consumed.

    ``generator``: the ``torch.Generator`` given to the DataLoader; it is seeded from (seed, epoch)
    before each epoch, so the workers' ``base_seed`` (and with it each worker's RNG) is the same
    as in the run that saved the position.
    """

    def __init__(self, sampler: ResumableSampler, generator: Any = None) -> None:
        self.sampler = sampler
        self.generator = generator
        #: samples consumed since the job's first step, across restarts.
        self.consumed = 0

    def epoch_seed(self, epoch: int | None = None) -> int:
        """The seed of ``epoch`` (default: the current one) for the workers and per-sample RNGs."""
        return mix(self.sampler.seed, self.sampler.epoch if epoch is None else epoch, self.sampler.rank)

    def batches(self, loader: Any) -> Iterator[Any]:
        """The loader's batches, epoch after epoch from the current position, without end.

        The position advances by ``loader.batch_size`` (the last batch of an epoch: what was left)
        as each batch is handed to the loop, so a ``state_dict()`` taken after the loop's step on
        it counts it as consumed."""
        if getattr(loader, "persistent_workers", False):
            raise ValueError("persistent_workers keeps the first epoch's worker seeds: resume would drift")
        size = getattr(loader, "batch_size", None)
        if not isinstance(size, int) or size < 1:
            raise ValueError("the loader needs a batch_size (the position advances by it)")
        if getattr(loader, "sampler", None) is not self.sampler:
            raise ValueError("the loader does not read this position's sampler")
        while True:
            if len(self.sampler) > 0:
                seed = self.epoch_seed()
                if self.generator is not None:
                    self.generator.manual_seed(seed)
                if isinstance(loader.dataset, SeededSamples):
                    loader.dataset.epoch_seed = seed
                for batch in loader:
                    taken = min(size, len(self.sampler))
                    self.sampler.offset += taken
                    self.consumed += taken
                    yield batch
            self.sampler.set_epoch(self.sampler.epoch + 1)

    def state_dict(self) -> dict[str, Any]:
        """What the checkpoint saves: the sampler's position, the samples consumed and, for the
        record (it is derived, and checked on load), the epoch's worker seed."""
        return {**self.sampler.state_dict(), "consumed": self.consumed, "epoch_seed": self.epoch_seed()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        if state.get("epoch_seed") != self.epoch_seed():
            raise ValueError("the checkpoint's epoch seed differs from this code's: seeding changed")
        self.consumed = int(state.get("consumed", 0))
