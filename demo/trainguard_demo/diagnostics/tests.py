"""Stop-time diagnostics (ByteRobust §4.2-§4.3) as real torch code: what one machine runs.

* **Bit-wise alignment** -- every machine builds the same small reference model from a fixed seed,
  runs one training step on fixed input, and hashes the resulting parameters.  Healthy machines
  produce bit-identical digests; the odd one out (a faulty ALU, silent data corruption) is suspect.
* **Collective connectivity** -- all-gather over gloo between a machine and a peer, checking both
  that the collective completes within the timeout and that every gathered tensor holds exactly
  what its sender sent.

Each test returns a JSON-able answer; :mod:`.runner` compares the answers across machines.
torch is imported inside the tests, so importing this module is cheap.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

#: the reference model is tiny on purpose: the test checks arithmetic, not throughput.
_IN, _HIDDEN, _BATCH = 32, 64, 16


def alignment_digest(perturb: bool = False) -> str:
    """SHA-256 of the reference model's parameters after one fixed training step."""
    import torch

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # reduction order depends on the thread count; keep it fixed
    g = torch.Generator().manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(_IN, _HIDDEN), torch.nn.GELU(), torch.nn.Linear(_HIDDEN, _IN)
    ).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1)
    x = torch.randn(_BATCH, _IN, generator=g, dtype=torch.float64)
    y = torch.randn(_BATCH, _IN, generator=g, dtype=torch.float64)
    if perturb:  # low bits wrong in one input: what a marginal core does to a real step
        x[0, 0] *= 1 + 2**-30
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def connectivity_check(
    rank: int, world: int, port: int, timeout_s: float, corrupt: bool = False
) -> dict[str, Any]:
    """All-gather over gloo on 127.0.0.1:``port``; verifies every peer's payload bit for bit."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    t0 = time.monotonic()
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        mine = torch.full((4096,), float(rank + 1))
        if corrupt:  # a NIC/PCIe path that flips data in flight
            mine[7] += 0.5
        out = [torch.zeros(4096) for _ in range(world)]
        dist.all_gather(out, mine)
        bad = [i for i, t in enumerate(out) if not torch.equal(t, torch.full((4096,), float(i + 1)))]
        dist.destroy_process_group()
        ok, detail = not bad, f"corrupted payload from rank(s) {bad}" if bad else "ok"
    except Exception as exc:  # timeouts and refused connections are test results, not crashes
        ok, detail = False, f"{type(exc).__name__}: {str(exc)[:300]}"
    return {"ok": ok, "detail": detail, "ms": (time.monotonic() - t0) * 1000}


#: every test a machine can run, by name (what the test server forks on request).
TESTS: dict[str, Callable[..., dict[str, Any]]] = {
    "alignment": lambda perturb=False: {"ok": True, "digest": alignment_digest(perturb)},
    "connectivity": lambda **kw: connectivity_check(**kw),
}
