"""Stop-time diagnostics (ByteRobust §4.2-§4.3) as real torch code, one subprocess per machine.

* **Bit-wise alignment** -- every machine builds the same small reference model from a fixed seed,
  runs one training step on fixed input, and hashes the resulting parameters.  Healthy machines
  produce bit-identical digests; the odd one out (a faulty ALU, silent data corruption) is suspect.
  With no strict majority nobody can be trusted, so every machine is flagged.
* **Collective connectivity** -- all-gather over gloo between each machine and its ring
  neighbour (the paper tests "each machine and its neighbours"), checking both that the collective
  completes within the timeout and that every gathered tensor holds exactly what its sender sent.
  A machine is suspect when *all* its pairs fail; if every pair fails, all machines are flagged
  (a fabric-wide problem is not one machine's fault -- the blast-radius guard then holds it).

Run on a machine as ``python -m actions.diagnostics alignment`` or ``... connectivity --rank R
--world 2 --port P``; each prints one JSON object.  :func:`run_local` runs both for N local
"machines" (subprocesses on 127.0.0.1), with injectable faults for tests and the demo.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from actions.executors.base import DiagnosticResult

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


# --- running the tests on local "machines" (subprocesses) -----------------------------------------


@dataclass(frozen=True)
class LocalFaults:
    """Injected faults for local runs: which machines misbehave, and how."""

    perturb: frozenset[str] = frozenset()  # wrong alignment arithmetic
    corrupt: frozenset[str] = frozenset()  # corrupts all-gather payloads
    absent: frozenset[str] = frozenset()  # never joins the collective (unreachable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "actions.diagnostics", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _collect(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"ok": False, "detail": f"no answer within {timeout_s:g} s"}
    if proc.returncode != 0:
        return {"ok": False, "detail": f"exit {proc.returncode}: {err.strip()[-300:]}"}
    try:
        data: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"ok": False, "detail": f"unreadable output {out[-200:]!r}"}
    return data


def run_alignment(
    machines: list[str], faults: LocalFaults, timeout_s: float = 60.0
) -> list[DiagnosticResult]:
    t0 = time.monotonic()
    procs = {m: _spawn(["alignment", *(["--perturb"] if m in faults.perturb else [])]) for m in machines}
    answers = {m: _collect(p, timeout_s) for m, p in procs.items()}
    ms = (time.monotonic() - t0) * 1000
    digests: dict[str, str] = {m: str(a["digest"]) for m, a in answers.items() if a.get("digest")}
    common, count = collections.Counter(digests.values()).most_common(1)[0] if digests else ("", 0)
    majority = count * 2 > len(machines)
    out = []
    for m in machines:
        d = digests.get(m)
        if d is None:
            out.append(DiagnosticResult(m, "alignment", False, answers[m].get("detail", "no digest"), ms))
        elif not majority:
            out.append(DiagnosticResult(m, "alignment", False, f"no majority digest ({d[:12]})", ms))
        else:
            detail = "bit-identical" if d == common else f"digest {d[:12]} != majority {common[:12]}"
            out.append(DiagnosticResult(m, "alignment", d == common, detail, ms))
    return out


def ring_pairs(n: int) -> list[tuple[int, int]]:
    """Each machine with its ring neighbour (one pair for two machines)."""
    if n < 2:
        return []
    return [(0, 1)] if n == 2 else [(i, (i + 1) % n) for i in range(n)]


def run_connectivity(
    machines: list[str], faults: LocalFaults, timeout_s: float = 20.0
) -> list[DiagnosticResult]:
    t0 = time.monotonic()
    pairs = ring_pairs(len(machines))
    running = []
    for a, b in pairs:
        port = free_port()
        procs: list[subprocess.Popen[str] | None] = []
        for rank, idx in enumerate((a, b)):
            m = machines[idx]
            if m in faults.absent:
                procs.append(None)
                continue
            args = ["connectivity", "--rank", str(rank), "--world", "2", "--port", str(port)]
            args += ["--timeout", str(timeout_s), *(["--corrupt"] if m in faults.corrupt else [])]
            procs.append(_spawn(args))
        running.append(((a, b), procs))
    passed: dict[tuple[int, int], bool] = {}
    details: dict[int, list[str]] = collections.defaultdict(list)
    for (a, b), procs in running:
        answers = [_collect(p, timeout_s + 30) if p else {"ok": False, "detail": "absent"} for p in procs]
        passed[(a, b)] = all(x.get("ok") for x in answers)
        for idx, ans in zip((a, b), answers, strict=True):
            details[idx].append(f"with {machines[b if idx == a else a]}: {ans.get('detail')}")
    ms = (time.monotonic() - t0) * 1000
    everything_failed = bool(passed) and not any(passed.values())
    out = []
    for i, m in enumerate(machines):
        mine = [ok for pair, ok in passed.items() if i in pair]
        ok = not everything_failed and (not mine or any(mine))
        out.append(DiagnosticResult(m, "connectivity", ok, "; ".join(details[i]) or "no peer", ms))
    return out


def run_local(
    machines: list[str], tests: Iterable[str], faults: LocalFaults | None = None, timeout_s: float = 30.0
) -> list[DiagnosticResult]:
    """Both stop-time tests for local machines (subprocesses); one result per (machine, test)."""
    faults = faults or LocalFaults()
    out: list[DiagnosticResult] = []
    for test in tests:
        if test == "alignment":
            out += run_alignment(machines, faults, timeout_s * 2)
        elif test == "connectivity":
            out += run_connectivity(machines, faults, timeout_s)
        else:
            raise ValueError(f"unknown test {test!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m actions.diagnostics", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="test", required=True)
    a = sub.add_parser("alignment", help="print the reference step's parameter digest")
    a.add_argument("--perturb", action="store_true", help="inject a one-ulp arithmetic fault")
    c = sub.add_parser("connectivity", help="gloo all-gather with peers on 127.0.0.1")
    c.add_argument("--rank", type=int, required=True)
    c.add_argument("--world", type=int, required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--timeout", type=float, default=20.0)
    c.add_argument("--corrupt", action="store_true", help="send a corrupted payload")
    ns = p.parse_args(argv)
    if ns.test == "alignment":
        print(json.dumps({"ok": True, "digest": alignment_digest(ns.perturb)}))
    else:
        print(json.dumps(connectivity_check(ns.rank, ns.world, ns.port, ns.timeout, ns.corrupt)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
