"""One rank of the ``collective`` test, run as ``python -m trainguard.diag.collective_worker SPEC``.

SPEC is a JSON object (rank, world, backend, init method, sizes, iterations, timeout).  The rank
joins the process group, runs an all-reduce (sum) and an all-gather of each size on tensors whose
every element it can predict -- small integers held exactly in float32 -- counts the elements
that came back wrong, times ``iters`` more of each on the largest size, and prints one JSON line:
``{"rank", "device", "checks": [...], "bandwidth": [...]}``.  A separate process per rank is what
NCCL needs (one GPU per process) and what gloo on a CPU node needs to be a real exchange.

Kept apart from :mod:`trainguard.diag.collective` so ``-m`` runs a module the package has not
already imported (runpy warns otherwise), and so the parent never imports torch.distributed.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from typing import Any

#: element i of rank r's all-reduce input is (i % PERIOD + 1) * (r + 1): the sum over up to 365
#: ranks stays below 2**24, so float32 holds it exactly and "wrong" means wrong, not rounded (a node
#: has at most 16 GPUs, and the CPU run at most 64 processes).
PERIOD = 251
#: rank r's all-gather input is base + r * GATHER_STRIDE (distinct per rank, still exact).
GATHER_STRIDE = 1000


def base(torch: Any, numel: int, device: Any) -> Any:
    return (torch.arange(numel, dtype=torch.int64, device=device) % PERIOD + 1).to(torch.float32)


def check_all_reduce(torch: Any, dist: Any, numel: int, rank: int, world: int, device: Any) -> int:
    """Elements of an all-reduce (sum) result that differ from the known answer."""
    b = base(torch, numel, device)
    x = b * (rank + 1)
    dist.all_reduce(x)
    return int((x != b * (world * (world + 1) // 2)).sum())


def check_all_gather(torch: Any, dist: Any, numel: int, rank: int, world: int, device: Any) -> int:
    """Elements of an all-gather result that differ from what each rank sent."""
    b = base(torch, numel, device)
    outs = [torch.empty_like(b) for _ in range(world)]
    dist.all_gather(outs, b + rank * GATHER_STRIDE)
    return sum(int((outs[r] != b + r * GATHER_STRIDE).sum()) for r in range(world))


def _time(torch: Any, fn: Any, iters: int, device: Any) -> float:
    """Seconds per call of ``fn`` (after one warm-up call), the device drained around it."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / iters


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    rank, world, backend = int(spec["rank"]), int(spec["world"]), str(spec["backend"])
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend,
        init_method=spec["init"],
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=float(spec["timeout_s"])),
    )
    out: dict[str, Any] = {"rank": rank, "device": str(device), "checks": [], "bandwidth": []}
    try:
        for nbytes in spec["sizes"]:
            numel = max(1, int(nbytes) // 4)
            for op, check in (("all_reduce", check_all_reduce), ("all_gather", check_all_gather)):
                wrong = check(torch, dist, numel, rank, world, device)
                out["checks"].append({"op": op, "bytes": numel * 4, "wrong": wrong})
        numel = max(1, int(max(spec["sizes"])) // 4)
        x = torch.ones(numel, dtype=torch.float32, device=device)
        outs = [torch.empty_like(x) for _ in range(world)]
        iters = int(spec["iters"])
        dist.barrier()
        t_ar = _time(torch, lambda: dist.all_reduce(x), iters, device)
        dist.barrier()
        t_ag = _time(torch, lambda: dist.all_gather(outs, x), iters, device)
        size = numel * 4
        # nccl-tests' bus bandwidth (doc/PERFORMANCE.md): all-reduce moves 2(n-1)/n of the buffer
        # per rank, all-gather (n-1)/n of the gathered total.
        for op, seconds, algbytes, factor in (
            ("all_reduce", t_ar, size, 2 * (world - 1) / world),
            ("all_gather", t_ag, size * world, (world - 1) / world),
        ):
            algbw = algbytes / seconds / 1e9
            out["bandwidth"].append(
                {
                    "op": op,
                    "bytes": size,
                    "time_us": round(seconds * 1e6, 1),
                    "algbw_gbps": round(algbw, 3),
                    "busbw_gbps": round(algbw * factor, 3),
                }
            )
    finally:
        dist.destroy_process_group()
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m trainguard.diag.collective_worker SPEC_JSON", file=sys.stderr)
        return 2
    print(json.dumps(run(json.loads(argv[1]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
