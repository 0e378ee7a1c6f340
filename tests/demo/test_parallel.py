"""Process groups and tensor parallelism on real gloo groups (forked ranks, no torch re-import)."""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from trainguard_demo.config import ModelConfig
from trainguard_demo.corpus import VOCAB
from trainguard_demo.model import GPTStage
from trainguard_demo.parallel import ParallelContext, build_groups, global_grad_norm, init_distributed
from trainguard_demo.versions.v1 import activation

from tests.net import free_port
from trainguard.schemas.topology import JobTopology

CFG = ModelConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, seq_len=8)
TOKENS = torch.arange(16).reshape(2, 8) % len(VOCAB)


def _loss_and_grads(stage: GPTStage) -> tuple[float, torch.Tensor]:
    logits = stage(TOKENS)
    loss = F.cross_entropy(logits.reshape(-1, len(VOCAB)), TOKENS.roll(1).reshape(-1))
    loss.backward()
    assert stage.ln_f.weight.grad is not None
    return float(loss.detach()), stage.ln_f.weight.grad.clone()


def _rank(topo: JobTopology, rank: int, port: int, q: Any) -> None:
    try:
        torch.set_num_threads(1)
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        init_distributed(topo, rank, "127.0.0.1", port, 30)
        ctx = build_groups(topo, rank)
        members = {}
        for dim, group in (("tp", ctx.tp_group), ("dp", ctx.dp_group), ("pp", ctx.pp_group)):
            # Each rank adds 2**rank: the sum names exactly who is in the group.
            t = torch.tensor([1 << rank])
            if group is not None:
                dist.all_reduce(t, group=group)
            members[dim] = sorted(r for r in range(topo.world_size) if int(t) >> r & 1)
        result: dict[str, Any] = {"rank": rank, "groups": members}
        if topo.pp == 1:
            stage = GPTStage(CFG, len(VOCAB), ctx, 5, activation)
            result["loss"], result["ln_f_grad"] = _loss_and_grads(stage)
            result["grad_norm"] = float(global_grad_norm(stage, ctx))
        q.put(result)
        dist.destroy_process_group()
    except BaseException as exc:
        q.put({"rank": rank, "error": repr(exc)})


def _run(topo: JobTopology, port: int) -> dict[int, dict[str, Any]]:
    ctx = mp.get_context("fork")  # torch is already imported here: forked ranks start at once
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(topo, r, port, q)) for r in range(topo.world_size)]
    for p in procs:
        p.start()
    try:
        out = {}
        for _ in procs:
            res = q.get(timeout=60)
            assert "error" not in res, res
            out[res["rank"]] = res
        return out
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def test_groups_match_topology() -> None:
    topo = JobTopology(job="g", tp=2, pp=2, dp=2, ranks_per_machine=2)
    out = _run(topo, free_port())
    for rank, res in out.items():
        assert res["groups"] == {d: topo.group(d, rank) for d in ("tp", "dp", "pp")}


def test_tensor_parallel_matches_single_rank() -> None:
    topo1 = JobTopology(job="s", tp=1, ranks_per_machine=1)
    single = GPTStage(
        CFG, len(VOCAB), ParallelContext(topo1, 0, topo1.coords(0), None, None, None), 5, activation
    )
    loss, grad = _loss_and_grads(single)
    norm = torch.cat([p.grad.reshape(-1) for p in single.parameters() if p.grad is not None]).norm()
    out = _run(JobTopology(job="tp", tp=2, ranks_per_machine=2), free_port())
    for res in out.values():
        assert res["loss"] == pytest.approx(loss, rel=1e-5)
        assert torch.allclose(res["ln_f_grad"], grad, atol=1e-6)
        assert res["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
