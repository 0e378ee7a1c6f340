"""A tiny but real 3D-parallel (TP x PP x DP) gloo training job used to capture stack fixtures.

One process per rank (launched by ``scripts/capture_stack_fixtures.py`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT``).  The job mirrors the
communication pattern of Megatron-LM on CPU so that py-spy sees the same kinds of frames a
hung production job shows:

* every TP/DP/PP group is created with ``new_group`` (all ranks create all groups, in order);
* forward: ``recv_forward`` from the previous stage, a row-parallel linear whose output is
  all-reduced in the TP group, ``send_forward`` to the next stage;
* backward: ``recv_backward`` from the next stage, a TP all-reduce of the input grad (the
  column-parallel backward), ``send_backward`` to the previous stage;
* ``finalize_model_grads``: DP all-reduce of every grad;
* a DataLoader with one worker process, and optionally an asynchronous checkpoint writer
  process whose previous save the optimizer step waits for (ByteRobust §6.3 ordering).

Faults (``--fault``, on ``--fault-rank`` from step ``--fault-step``): ``compute_hang`` (spins in
the forward matmul), ``dataloader_hang`` (the worker blocks reading a FIFO nobody writes),
``checkpoint_hang`` (the writer blocks opening a FIFO checkpoint path), ``skip_send`` (the
forward send to the next stage is skipped), ``slow_rank`` (the rank's forward compute takes
``--slow-factor`` times ``--compute-s``: a fail-slow straggler running the same code slower),
``skip_allreduce`` (the rank leaves out its DP gradient all-reduce: a collective the others wait in),
``mismatch_allreduce`` (its DP all-reduce has a different size), ``die`` (the process exits),
``stop_in_allreduce`` (the rank marks ``stopped_rank<R>`` and stops itself with SIGSTOP on the way
into its DP all-reduce: a process frozen inside a collective).  ``--also-fault-rank R`` (repeatable)
gives more ranks the same fault at the same step; ``--ep N`` adds expert-parallel groups (each DP
group split into runs of N) with one all-reduce per step in them, Megatron's MoE token exchange.

``--fr-dir DIR`` turns PyTorch's Flight Recorder on (``TORCH_FR_BUFFER_SIZE``) and starts a thread
that, once ``DIR/dump-now`` exists, writes the rank's dump in both of PyTorch's formats:
``DIR/pickle/fr_trace_rank_<R>`` (``_dump_fr_trace``) and ``DIR/json/fr_trace_rank_<R>``
(``_dump_fr_trace_json``), the names PyTorch gives its own dumps (``<prefix><rank>``).  A rank
whose collective raised (a peer died) keeps its process so that it can still be dumped.
The function names follow Megatron's on purpose: the analyser's pattern table targets real
framework names, and this job stands in for such a framework.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

HIDDEN = 16


class Topo:
    """Megatron's default tp-dp-pp order: rank = tp + TP*dp + TP*DP*pp."""

    def __init__(self, tp: int, pp: int, dp: int, rank: int) -> None:
        self.tp, self.pp, self.dp = tp, pp, dp
        self.tp_i = rank % tp
        self.dp_i = (rank // tp) % dp
        self.pp_i = rank // (tp * dp)

    def rank(self, tp_i: int, dp_i: int, pp_i: int) -> int:
        return tp_i + self.tp * dp_i + self.tp * self.dp * pp_i


def build_groups(t: Topo) -> dict[str, Any]:
    """Every rank must call new_group for every group in the same order (torch requirement)."""
    mine: dict[str, Any] = {}
    for kind in ("tp", "dp", "pp"):
        for a in range({"tp": t.dp, "dp": t.tp, "pp": t.tp}[kind]):
            for b in range({"tp": t.pp, "dp": t.pp, "pp": t.dp}[kind]):
                if kind == "tp":
                    ranks = [t.rank(i, a, b) for i in range(t.tp)]
                elif kind == "dp":
                    ranks = [t.rank(a, i, b) for i in range(t.dp)]
                else:
                    ranks = [t.rank(a, b, i) for i in range(t.pp)]
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    mine[kind] = group
    return mine


def build_expert_groups(t: Topo, ep: int) -> Any:
    """Expert-parallel groups of ``ep`` ranks: each DP group split into runs of ``ep`` consecutive
    data-parallel ranks (same TP index and stage), as Megatron carves expert parallelism out of
    data parallelism.  None of them is a TP, PP or DP group: the analysis must learn them from the
    dumps.  Every rank creates every group, in order; returns this rank's."""
    mine = None
    for pp_i in range(t.pp):
        for tp_i in range(t.tp):
            for start in range(0, t.dp, ep):
                ranks = [t.rank(tp_i, d, pp_i) for d in range(start, start + ep)]
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    mine = group
    return mine


class TokenDataset(Dataset[torch.Tensor]):
    """Deterministic random samples; on the faulty rank the worker blocks like a stuck storage read."""

    def __init__(self, hang_from: int | None, fifo: str) -> None:
        self.hang_from = hang_from
        self.fifo = fifo

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, idx: int) -> torch.Tensor:
        if self.hang_from is not None and idx >= self.hang_from:
            read_shard(self.fifo)
        g = torch.Generator().manual_seed(idx)
        return torch.randn(HIDDEN, generator=g)


def read_shard(path: str) -> bytes:
    # Opening a FIFO for reading blocks until a writer appears: a storage read that never returns.
    with open(path, "rb") as fh:
        return fh.read()


def checkpoint_writer(jobs: Any, acks: Any) -> None:
    """Asynchronous checkpoint process: torch.save each state dict it is handed, then acknowledge."""
    while True:
        job = jobs.get()
        if job is None:
            return
        path, state = job
        torch.save(state, path)
        acks.put(path)


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Identity forward, TP all-reduce of the grad in backward (Megatron's column-parallel input)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    out = x.detach().clone()
    dist.all_reduce(out, group=group)
    # Gradient of a sum-all-reduce is the identity: keep the local graph, take the reduced value.
    return x + (out - x).detach()


class Stage:
    def __init__(self, args: argparse.Namespace, t: Topo, groups: dict[str, Any]) -> None:
        self.args, self.t, self.groups = args, t, groups
        torch.manual_seed(t.pp_i)
        self.weight = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.1)
        self.opt = torch.optim.SGD([self.weight], lr=1e-3)
        self.prev = t.rank(t.tp_i, t.dp_i, t.pp_i - 1) if t.pp_i > 0 else None
        self.next = t.rank(t.tp_i, t.dp_i, t.pp_i + 1) if t.pp_i < t.pp - 1 else None

    def faulty(self, step: int, kind: str) -> bool:
        a = self.args
        ranks = {a.fault_rank, *a.also_fault_rank}  # several faulty ranks: the same fault at once
        return a.fault == kind and dist.get_rank() in ranks and step >= a.fault_step

    def forward_step(self, x: torch.Tensor, step: int) -> torch.Tensor:
        x = _CopyToTensorParallelRegion.apply(x, self.groups["tp"])
        y = x @ self.weight
        if self.faulty(step, "compute_hang"):
            spin_compute(y)
        seconds = self.args.compute_s * (self.args.slow_factor if self.faulty(step, "slow_rank") else 1.0)
        if seconds > 0:
            dense_compute(y, seconds)
        y = reduce_from_tensor_model_parallel_region(y, self.groups["tp"])
        if self.groups.get("ep") is not None:
            moe_token_dispatch(y, self.groups["ep"])
        return torch.tanh(y)


def moe_token_dispatch(y: torch.Tensor, group: Any) -> None:
    # Stands in for a MoE layer's token exchange: one collective per step in the expert group
    # (an all-reduce: gloo's all_to_all on CPU is not in every build), off the autograd graph.
    tokens = y.detach().clone()
    dist.all_reduce(tokens, group=group)


def spin_compute(y: torch.Tensor) -> None:
    # A kernel that never finishes: keep the CPU busy in real matmuls forever.
    z = y.detach()
    while True:
        z = torch.tanh(z @ z.T @ z)


def dense_compute(y: torch.Tensor, seconds: float) -> None:
    # Stands in for the layer's GPU work: the host is busy for ``seconds`` (a straggler -- thermal
    # throttling, a degraded GPU -- runs this same code for longer).  Short sleeps leave the two
    # CPU cores of the capture machine to the other ranks.
    end = time.monotonic() + seconds
    z = y.detach()
    while time.monotonic() < end:
        z = torch.tanh(z @ z.T @ z)
        time.sleep(0.002)


def recv_forward(stage: Stage) -> torch.Tensor:
    buf = torch.empty(1, HIDDEN)
    dist.recv(buf, src=stage.prev)
    return buf.requires_grad_()


def send_forward(stage: Stage, y: torch.Tensor) -> None:
    dist.send(y.detach().contiguous(), dst=stage.next)


def recv_backward(stage: Stage) -> torch.Tensor:
    buf = torch.empty(1, HIDDEN)
    dist.recv(buf, src=stage.next)
    return buf


def send_backward(stage: Stage, grad: torch.Tensor) -> None:
    dist.send(grad.contiguous(), dst=stage.prev)


def finalize_model_grads(stage: Stage, step: int) -> None:
    grad = stage.weight.grad
    assert grad is not None
    if stage.faulty(step, "skip_allreduce"):
        return
    if stage.faulty(step, "die"):
        os._exit(1)
    if stage.faulty(step, "stop_in_allreduce"):
        (Path(stage.args.workdir) / f"stopped_rank{dist.get_rank()}").write_text(str(step))
        os.kill(os.getpid(), signal.SIGSTOP)
    if stage.faulty(step, "mismatch_allreduce"):
        grad = torch.zeros(HIDDEN + 1, HIDDEN)
    dist.all_reduce(grad, group=stage.groups["dp"])
    grad /= stage.t.dp


def flight_recorder_dumper(fr_dir: Path, rank: int) -> None:
    """Wait for ``fr_dir/dump-now``, then write this rank's Flight Recorder dump in both formats."""
    from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json

    while not (fr_dir / "dump-now").exists():
        time.sleep(0.1)
    for fmt, dump in (("pickle", _dump_fr_trace), ("json", _dump_fr_trace_json)):
        (fr_dir / fmt).mkdir(parents=True, exist_ok=True)
        tmp = fr_dir / fmt / f".fr_trace_rank_{rank}.tmp"
        tmp.write_bytes(dump())
        tmp.rename(fr_dir / fmt / f"fr_trace_rank_{rank}")


def train_step(stage: Stage, batch: torch.Tensor, step: int) -> float:
    s = stage
    x = batch.view(1, HIDDEN).requires_grad_() if s.prev is None else recv_forward(s)
    y = s.forward_step(x, step)
    if s.next is not None:
        if not s.faulty(step, "skip_send"):
            send_forward(s, y)
        grad_y = recv_backward(s)
        y.backward(grad_y)
        loss = 0.0
    else:
        out = (y**2).mean()
        out.backward()
        loss = float(out)
    if s.prev is not None:
        assert x.grad is not None
        send_backward(s, x.grad)
    finalize_model_grads(s, step)
    return loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--fault", default="none")
    p.add_argument("--fault-rank", type=int, default=-1)
    p.add_argument("--also-fault-rank", type=int, action="append", default=[],
                   help="another rank with the same fault at the same step (repeatable)")  # fmt: skip
    p.add_argument("--fault-step", type=int, default=3)
    p.add_argument(
        "--ep", type=int, default=1, help="expert-parallel group size (> 1: one collective per step)"
    )
    p.add_argument("--compute-s", type=float, default=0.0, help="forward compute per step, every rank")
    p.add_argument("--slow-factor", type=float, default=3.0, help="slow_rank: compute takes this much longer")
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--checkpoint", action="store_true")
    p.add_argument("--workdir", required=True)
    p.add_argument("--fr-dir", help="enable the Flight Recorder; dump here on DIR/dump-now")
    p.add_argument("--fr-entries", type=int, default=2000, help="Flight Recorder ring buffer size")
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    if args.fr_dir:
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(args.fr_entries)  # read when the groups are made
        threading.Thread(target=flight_recorder_dumper, args=(Path(args.fr_dir), rank), daemon=True).start()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t = Topo(args.tp, args.pp, args.dp, rank)
    groups = build_groups(t)
    if args.ep > 1:
        groups["ep"] = build_expert_groups(t, args.ep)
    stage = Stage(args, t, groups)
    work = Path(args.workdir)

    # Only the faulty rank's worker hangs; every sample index of a step is step*1 (batch size 1).
    data_hang = args.fault_step if args.fault == "dataloader_hang" and rank == args.fault_rank else None
    loader = DataLoader(TokenDataset(data_hang, str(work / "data.fifo")), batch_size=1, num_workers=1)
    batches = iter(loader)

    ckpt_jobs: Any = None
    ckpt_acks: Any = None
    pending = False
    if args.checkpoint:
        ctx = mp.get_context("fork")
        ckpt_jobs, ckpt_acks = ctx.Queue(), ctx.Queue()
        ctx.Process(target=checkpoint_writer, args=(ckpt_jobs, ckpt_acks), daemon=True).start()

    step = 0
    while True:
        batch = next(batches)
        try:
            train_step(stage, batch, step)
        except RuntimeError:  # a peer is gone: stay, as a hung job does, to be dumped
            traceback.print_exc()
            while True:
                time.sleep(1)
        if pending:
            wait_for_checkpoint(ckpt_acks)
            pending = False
        stage.opt.step()
        stage.opt.zero_grad()
        if ckpt_jobs is not None:
            hang = args.fault == "checkpoint_hang" and rank == args.fault_rank and step >= args.fault_step
            path = work / ("ckpt.fifo" if hang else f"ckpt_rank{rank}.pt")
            ckpt_jobs.put((str(path), {"weight": stage.weight.detach().clone(), "step": step}))
            pending = True
        (work / f"step_rank{rank}").write_text(str(step))
        step += 1
        time.sleep(args.step_sleep)


def wait_for_checkpoint(acks: Any) -> None:
    # The optimizer step must not overwrite state the writer has not saved yet.
    acks.get()


if __name__ == "__main__":
    main()
