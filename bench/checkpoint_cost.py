"""Step-time cost of every-step checkpoints with a peer backup, and restore time (#37 item 3).

``python bench/checkpoint_cost.py [--steps 40] [--runs 3]`` trains a small GPT on CPU -- the
demo's model shape (d_model 64, 4 heads, 2 layers, d_ff 128, seq 32, 30-character vocabulary;
the whole model on one rank) and one about 10x larger (d_model 208, d_ff 416) -- with AdamW,
first without checkpoints, then with :class:`trainguard.training.Checkpointer` saving every step:
a host-memory snapshot, the shard on the local disk and a backup sent over TCP to the peer rank.
The job has two ranks (DP=2, one per "machine" folder), each its own process training the same
model at the same time, each the other's backup peer; rank 0 is timed.  Then it times two
restores of rank 0: in place (its own disk) and on a replacement machine with an empty disk that
pulls its shard from rank 1's server over TCP.

Printed per size: the median over ``--runs`` runs of each run's mean step time without and with
checkpoints, the overhead, the share of steps saved and backed up (the sender sends the newest
shard: one superseded while the previous was still on its way is not sent), the loop's time
inside ``save()`` per step (copying to host memory, waiting for the writer), rank 0's CPU time
per step (all its threads; the figure a loaded machine does not distort), and the two restore
times.  ``--when-behind
skip`` lets a rank skip a step's checkpoint while its writer is still busy instead of waiting.
Torch runs one thread per rank: two ranks on this 2-core machine, as a GPU job's ranks leave
their CPU mostly free for the writer.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainguard.training import CheckpointConfig, Checkpointer

VOCAB, SEQ, BATCH = 30, 32, 8
#: name -> (d_model, n_heads, n_layers, d_ff): the demo's GPT, and one about 10x its parameters.
SIZES = {"demo": (64, 4, 2, 128), "10x": (208, 4, 2, 416)}


class GPT(nn.Module):
    def __init__(self, d: int, heads: int, layers: int, ff: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB)
        self.mask = nn.Transformer.generate_square_subsequent_mask(SEQ)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        return self.head(self.ln(self.blocks(h, mask=self.mask, is_causal=True)))


def build(size: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(*SIZES[size])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(
    model: nn.Module, opt: torch.optim.Optimizer, first: int, steps: int, ckpt: Checkpointer | None
) -> list[float]:
    times = []
    for step in range(first, first + steps):
        t0 = time.perf_counter()
        x = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ckpt is not None:
            ckpt.save(step, model, opt)
        times.append(time.perf_counter() - t0)
    return times


#: ``--when-behind``: wait for the writer (every step saved) or skip a step while it is behind.
WHEN_BEHIND = "wait"


def checkpointer(directory: Path, rank: int) -> Checkpointer:
    cfg = CheckpointConfig(
        job="bench", directory=str(directory), rank=rank, dp=2, ranks_per_machine=1,
        listen_host="127.0.0.1", when_behind=WHEN_BEHIND,
    )  # fmt: skip
    c = Checkpointer(cfg)
    c.start()
    return c


class Job:
    """Rank 0 here, rank 1 in a child process running the same commands at the same time."""

    def __init__(self, size: str, tmp: Path) -> None:
        self.size, self.tmp, self.step = size, tmp, 1
        self.peer = subprocess.Popen(
            [sys.executable, __file__, "--peer", str(tmp / "machine-1"), size, "--when-behind", WHEN_BEHIND],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.peer_address = self._reply()
        self.model, self.opt = build(size)

    def _send(self, line: str) -> None:
        assert self.peer.stdin is not None
        self.peer.stdin.write(line + "\n")
        self.peer.stdin.flush()

    def _reply(self) -> str:
        assert self.peer.stdout is not None
        line = self.peer.stdout.readline().strip()
        if not line:
            raise RuntimeError("the peer rank exited")
        return line

    def train(self, steps: int, ckpt: Checkpointer | None) -> list[float]:
        self._send(f"train {self.step} {steps} {int(ckpt is not None)}")
        times = train(self.model, self.opt, self.step, steps, ckpt)
        if ckpt is not None:
            ckpt.flush(60)
        self._reply()
        self.step += steps
        return times

    def close(self) -> None:
        if self.peer.stdin is not None:
            self.peer.stdin.close()
        self.peer.wait(60)


def one_run(size: str, steps: int, tmp: Path) -> dict[str, float]:
    job = Job(size, tmp)
    try:
        ckpt = checkpointer(tmp / "machine-0", 0)
        ckpt.connect([ckpt.address, job.peer_address])
        job._send(f"connect {ckpt.address}")
        job.train(5, None)  # warm-up: first-call allocations and kernels
        cpu0 = time.process_time()
        plain = statistics.fmean(job.train(steps, None))
        cpu_plain = (time.process_time() - cpu0) / steps
        job.train(3, ckpt)  # warm-up: the two host buffers are allocated here
        before = ckpt.stats()
        cpu0 = time.process_time()
        with_ckpt = statistics.fmean(job.train(steps, ckpt))
        # This process's CPU (every thread: the loop, the writer, the sender, and the server
        # taking the peer's backup): what checkpoints cost however loaded the machine is.
        cpu_ckpt = (time.process_time() - cpu0) / steps
        s = ckpt.stats()
        saved = s.snapshots - before.snapshots
        assert s.write_failures == s.backup_failures == 0, s
        ckpt.close()
        out = {
            "plain_ms": plain * 1e3, "ckpt_ms": with_ckpt * 1e3, "saved_pct": 100 * saved / steps,
            "backed_pct": 100 * (s.backed_up - before.backed_up) / steps,
            "cpu_plain_ms": cpu_plain * 1e3, "cpu_ckpt_ms": cpu_ckpt * 1e3,
            "snapshot_ms": (s.snapshot_s - before.snapshot_s) / steps * 1e3,
            "waited_ms": (s.blocked_s - before.blocked_s) / steps * 1e3,
        }  # fmt: skip
        for key, directory in (
            ("restore_local_s", tmp / "machine-0"),
            ("restore_peer_s", tmp / "replacement"),
        ):
            fresh, fresh_opt = build(size)
            c = checkpointer(directory, 0)
            c.connect([c.address, job.peer_address])
            t0 = time.perf_counter()
            r = c.restore(fresh, fresh_opt)
            out[key] = time.perf_counter() - t0
            assert r.step is not None and (r.source == "local") == (key == "restore_local_s"), r
            c.close()
        return out
    finally:
        job.close()


def peer_main(directory: str, size: str) -> None:
    """Rank 1: trains on command, checkpointing to its disk and backing up to rank 0."""
    torch.set_num_threads(1)
    model, opt = build(size)
    ckpt = checkpointer(Path(directory), 1)
    print(ckpt.address, flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "connect":
            ckpt.connect([args[0], ckpt.address])
        elif cmd == "train":
            first, steps, on = map(int, args)
            train(model, opt, first, steps, ckpt if on else None)
            ckpt.flush(60)
            print("done", flush=True)
    ckpt.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--when-behind", choices=("wait", "skip"), default="wait")
    ap.add_argument("--peer", nargs=2, metavar=("DIR", "SIZE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    global WHEN_BEHIND
    WHEN_BEHIND = args.when_behind
    if args.peer:
        return peer_main(*args.peer)
    # The two ranks share the job's checkpoint key (the peer process inherits it), as a batch
    # script's `export TRAINGUARD_CHECKPOINT_KEY=...` gives every rank the same one.
    os.environ.setdefault("TRAINGUARD_CHECKPOINT_KEY", secrets.token_hex(32))
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, 1 thread per rank, CPU; {args.runs} runs of {args.steps} steps; "
        f"when_behind={WHEN_BEHIND}"
    )
    for size in SIZES:
        model, _ = build(size)
        n = sum(p.numel() for p in model.parameters())
        runs = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as d:
                runs.append(one_run(size, args.steps, Path(d)))
        med: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        shard_mb = len(_shard_bytes(size)) / 1e6
        overhead = 100 * (med["ckpt_ms"] / med["plain_ms"] - 1)
        print(
            f"{size:>4}: {n:,} params, shard {shard_mb:.1f} MB | step {med['plain_ms']:.1f} ms plain, "
            f"{med['ckpt_ms']:.1f} ms checkpointing every step (+{overhead:.1f}%; "
            f"{med['saved_pct']:.0f}% of steps saved, {med['backed_pct']:.0f}% backed up), "
            f"in save() {med['snapshot_ms']:.2f} ms copying + {med['waited_ms']:.2f} ms waiting for the "
            f"writer | CPU per step {med['cpu_plain_ms']:.1f} -> {med['cpu_ckpt_ms']:.1f} ms "
            f"| restore {med['restore_local_s'] * 1e3:.0f} ms local, "
            f"{med['restore_peer_s'] * 1e3:.0f} ms from the peer (medians of {args.runs})"
        )


def _shard_bytes(size: str) -> bytes:
    """One shard's serialized bytes (model + AdamW state after a step), for the size column."""
    from trainguard.streams.checkpoint.state import encode, snapshot_into

    model, opt = build(size)
    train(model, opt, 1, 1, None)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    return b"".join(encode(snapshot_into(state, None, torch.Tensor), torch.Tensor))


if __name__ == "__main__":
    main()
