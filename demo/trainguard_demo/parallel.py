"""Process groups and the collective building blocks of TP, PP and DP (gloo, CPU).

:func:`build_groups` creates one gloo group per TP, DP and PP group of the
:class:`~trainguard.schemas.topology.JobTopology` (every rank must create every group, in the same order,
which is why it walks all groups rather than only its own).  The TP layers follow Megatron-LM:

* :class:`ColumnParallelLinear` keeps a slice of the output features; its input passes through
  ``copy_to_tp`` (identity forward, all-reduce of the gradient backward);
* :class:`RowParallelLinear` keeps a slice of the input features; its partial outputs are summed
  by ``reduce_from_tp`` (all-reduce forward, identity backward).

Weights are drawn full-size from a per-layer seed and then sliced, so every TP size starts from
the same model.
"""

from __future__ import annotations

import math
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainguard.schemas.topology import DIMS, Coords, JobTopology

Group = Any  # torch's ProcessGroup; typed loosely because its stub varies between releases


@dataclass
class ParallelContext:
    """This rank's place in the job and its TP/DP/PP groups (``None`` for a size-1 group)."""

    topology: JobTopology
    rank: int
    coords: Coords
    tp_group: Group
    dp_group: Group
    pp_group: Group

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.topology.pp - 1

    def pp_neighbour(self, delta: int) -> int:
        """Global rank of the previous (-1) or next (+1) pipeline stage with this tp/dp index."""
        c = self.coords
        return self.topology.rank(tp=c.tp, dp=c.dp, pp=c.pp + delta)


def init_distributed(topology: JobTopology, rank: int, addr: str, port: int, timeout_s: float) -> None:
    """Join the job's default gloo group through a TCP rendezvous at ``addr:port`` (rank 0 hosts it).

    Ranks other than 0 first wait for the store to listen: the store client retries a refused
    connection only after a backoff, which made every restart whose rank 0 woke a little after
    its peers wait ~0.4 s more (measured: server 0.3 s late -> joined at 0.71 s; with the wait,
    at 0.32 s)."""
    if rank != 0:
        _wait_listening(addr, port, timeout_s)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=topology.world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def _wait_listening(addr: str, port: int, timeout_s: float) -> None:
    """Return once ``addr:port`` accepts a connection (or after ``timeout_s``: then the store
    client's own retries and timeout take over)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.01)


def build_groups(topology: JobTopology, rank: int) -> ParallelContext:
    """Create every TP/DP/PP group (collectively, on all ranks) and keep this rank's own."""
    mine: dict[str, Group] = {}
    for dim in DIMS:
        for members in topology.groups(dim):
            if len(members) == 1:
                continue  # a size-1 group needs no communicator
            group = dist.new_group(members, backend="gloo")
            if rank in members:
                mine[dim] = group
    return ParallelContext(
        topology=topology,
        rank=rank,
        coords=topology.coords(rank),
        tp_group=mine.get("tp"),
        dp_group=mine.get("dp"),
        pp_group=mine.get("pp"),
    )


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


def _full_weight(out_f: int, in_f: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(in_f)
    return (torch.rand(out_f, in_f, generator=g) * 2 - 1) * bound


class ColumnParallelLinear(nn.Module):
    """``y[:, slice] = x @ W[slice].T``: this TP rank's share of the output features."""

    #: parameters split across TP ranks (gradient-norm accounting counts them once per rank).
    tp_sharded = True

    def __init__(self, in_f: int, out_f: int, tp: int, tp_rank: int, group: Group, seed: int) -> None:
        super().__init__()
        part = out_f // tp
        full = _full_weight(out_f, in_f, seed)
        self.weight = nn.Parameter(full[tp_rank * part : (tp_rank + 1) * part].clone())
        self.bias = nn.Parameter(torch.zeros(part))
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum over TP ranks of x[:, slice] @ W[:, slice].T`` plus a replicated bias."""

    tp_sharded = True

    def __init__(self, in_f: int, out_f: int, tp: int, tp_rank: int, group: Group, seed: int) -> None:
        super().__init__()
        part = in_f // tp
        full = _full_weight(out_f, in_f, seed)
        self.weight = nn.Parameter(full[:, tp_rank * part : (tp_rank + 1) * part].clone())
        # The bias is added after the all-reduce, so it is replicated, not sharded.
        self.bias = nn.Parameter(torch.zeros(out_f))
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(F.linear(x, self.weight), self.group) + self.bias


def sharded_param_names(model: nn.Module) -> set[str]:
    """Names of parameters that differ between TP ranks (the others are replicated)."""
    out = set()
    for mod_name, mod in model.named_modules():
        if getattr(mod, "tp_sharded", False):
            out.add(f"{mod_name}.weight")
            if isinstance(mod, ColumnParallelLinear):
                out.add(f"{mod_name}.bias")
    return out


def allreduce_dp_grads(model: nn.Module, ctx: ParallelContext) -> None:
    """Average gradients over the DP group with one flat all-reduce (fewer, larger messages)."""
    if ctx.dp_group is None:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=ctx.dp_group)
    flat /= ctx.topology.dp
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def global_grad_norm(model: nn.Module, ctx: ParallelContext) -> torch.Tensor:
    """L2 norm of the whole model's gradient: TP-sharded parts summed over TP, replicated parts
    counted once, stages summed over PP (DP replicas hold the same averaged gradient)."""
    sharded = sharded_param_names(model)
    tp = ctx.topology.tp
    total = torch.zeros(1, dtype=torch.float64)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        sq = p.grad.double().pow(2).sum()
        total += sq if name in sharded else sq / tp
    for group in (ctx.tp_group, ctx.pp_group):
        if group is not None:
            dist.all_reduce(total, group=group)
    return total.sqrt().float()


def send(t: torch.Tensor, dst: int) -> None:
    dist.send(t.contiguous(), dst=dst)


def recv(shape: tuple[int, ...], src: int) -> torch.Tensor:
    buf = torch.empty(shape)
    dist.recv(buf, src=src)
    return buf
