"""``collective``: all-reduce and all-gather among this node's devices, every element checked, and
their bus bandwidth against an optional expected figure.

With two or more GPUs: NCCL, one process per GPU.  Otherwise (or with ``backend: gloo``): gloo
among ``cpu_procs`` CPU processes, which checks the same code path on any machine.  ``backend:
nccl`` on a one-GPU node runs a single NCCL rank: NCCL's kernels checked, no bandwidth.  Each rank is a
:mod:`trainguard.diag.collective_worker` process; they meet through a file in a fresh temporary
directory (no port to pick, nothing left behind).  A rank that crashes, reports wrong elements or
does not finish within ``timeout_s`` (a hang, killed) is a finding.

Bandwidth is nccl-tests' bus bandwidth of the largest size, the slowest rank's; the all-reduce's
is checked against ``expected_busbw_gbps * min_fraction`` when set.

Not done: a peer node (``--peer host:port`` rendezvous for a two-node check of the inter-node
fabric); this test covers the devices of one node only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trainguard
from trainguard.diag.base import DiagContext, DiagResult, Skipped, register
from trainguard.diag.config import CollectiveConfig
from trainguard.diag.devices import cuda_devices, load_torch

KIB = 1 << 10
MIB = 1 << 20
#: the small size always checked besides the largest (latency-bound paths, e.g. NCCL's LL protocol).
SMALL_BYTES = 64 * KIB
#: the command of one rank (its JSON spec is appended); tests replace it with a crashing or
#: hanging stand-in.
WORKER = [sys.executable, "-m", "trainguard.diag.collective_worker"]
#: how long the other ranks may go on after one failed before they are killed.
GRACE_S = 10.0


def human_bytes(n: int) -> str:
    """>>> human_bytes(65536), human_bytes(3 << 20), human_bytes(100)
    ('64 KiB', '3 MiB', '100 B')
    """
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def choose_backend(wanted: str, gpus: int) -> str:
    """>>> choose_backend("auto", 8), choose_backend("auto", 1), choose_backend("gloo", 8)
    ('nccl', 'gloo', 'gloo')
    """
    if wanted == "auto":
        return "nccl" if gpus >= 2 else "gloo"
    return wanted


def _child_env(ctx: DiagContext, backend: str) -> dict[str, str]:
    env = ctx.environ
    # The ranks import this very trainguard, however the parent found it (a checkout on sys.path,
    # not only an installed package).
    root = str(Path(trainguard.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    if backend == "gloo":
        # All ranks are on this machine: loopback, whatever the hostname resolves to.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # n ranks of a CPU run share the cores: one math thread each instead of n x cores.
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _tail(path: Path, limit: int = 1500) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""
    return text[-limit:]


def run_ranks(
    ctx: DiagContext, backend: str, world: int, sizes: list[int], cfg: CollectiveConfig
) -> tuple[list[dict[str, Any]], list[str]]:
    """Start ``world`` ranks, wait for them (``cfg.timeout_s`` in all): their reports, and one
    problem per rank that gave none."""
    problems: list[str] = []
    reports: list[dict[str, Any]] = []
    env = _child_env(ctx, backend)
    with tempfile.TemporaryDirectory(prefix="trainguard-diag-") as tmp:
        base = {
            "world": world,
            "backend": backend,
            "init": f"file://{tmp}/rendezvous",
            "sizes": sizes,
            "iters": cfg.iters,
            "timeout_s": cfg.timeout_s,
        }
        procs: list[tuple[int, subprocess.Popen[bytes], Path, Path]] = []
        try:
            for rank in range(world):
                out, err = Path(tmp, f"rank{rank}.out"), Path(tmp, f"rank{rank}.err")
                # Files, not pipes: a chatty rank (NCCL_DEBUG=INFO) must not block on a full pipe
                # while the parent waits on another.
                with open(out, "wb") as fo, open(err, "wb") as fe:
                    proc = subprocess.Popen(
                        [*WORKER, json.dumps({**base, "rank": rank})],
                        stdout=fo,
                        stderr=fe,
                        stdin=subprocess.DEVNULL,
                        env=env,
                    )
                procs.append((rank, proc, out, err))
            left_behind = _wait(procs, cfg.timeout_s)
            for rank, proc, out, err in procs:
                if proc.poll() is None:
                    problems.append(f"rank {rank} {left_behind}: killed")
                    continue
                report = _report(out)
                if proc.returncode != 0 or report is None:
                    problems.append(f"rank {rank} exited with {proc.returncode}: {_tail(err) or 'no output'}")
                else:
                    reports.append(report)
        finally:
            for _rank, proc, _out, _err in procs:
                if proc.poll() is None:
                    proc.kill()  # only the ranks this test started
                    proc.wait()
    return reports, problems


def _wait(procs: list[tuple[int, subprocess.Popen[bytes], Path, Path]], timeout_s: float) -> str:
    """Wait until every rank has exited, ``timeout_s`` has passed, or :data:`GRACE_S` after a rank
    failed (its peers would otherwise wait for it until the process group's own timeout); what
    still runs then is described by the returned phrase."""
    deadline = time.monotonic() + timeout_s
    failed_at: float | None = None
    while True:
        codes = [proc.poll() for _rank, proc, _out, _err in procs]
        now = time.monotonic()
        if all(c is not None for c in codes):
            return ""
        if now >= deadline:
            return f"did not finish within {timeout_s:g} s (a hang)"
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if failed_at is not None and now - failed_at > GRACE_S:
            return f"was still running {GRACE_S:g} s after another rank failed"
        time.sleep(0.05)


def _report(path: Path) -> dict[str, Any] | None:
    lines = [ln for ln in _tail(path, 1 << 20).splitlines() if ln.startswith("{")]
    if not lines:
        return None
    try:
        data = json.loads(lines[-1])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


@register("collective", "all-reduce and all-gather among the node's devices (NCCL, or gloo on CPU)")
def run(ctx: DiagContext, result: DiagResult) -> None:
    cfg: CollectiveConfig = ctx.section("collective")
    result.thresholds = {
        "wrong_elements": 0,
        "expected_busbw_gbps": cfg.expected_busbw_gbps,
        "min_fraction": cfg.min_fraction,
    }
    torch = load_torch("collective")
    if not torch.distributed.is_available():
        raise Skipped("this PyTorch build has no torch.distributed")
    gpus = cuda_devices(torch)
    backend = choose_backend(cfg.backend, gpus)
    if backend == "nccl":
        # Asked for by name, one GPU is enough: a lone rank still checks NCCL's kernels end to end
        # (no bandwidth then: nothing crosses a link).
        if gpus < 1:
            raise Skipped("backend nccl needs a GPU; this node has none")
        if not torch.distributed.is_nccl_available():
            raise Skipped("this PyTorch build has no NCCL")
        world, largest = gpus, cfg.max_mib * MIB
    else:
        if not torch.distributed.is_gloo_available():
            raise Skipped("this PyTorch build has no gloo")
        world, largest = cfg.cpu_procs, cfg.cpu_max_mib * MIB
    sizes = sorted({SMALL_BYTES, largest})
    result.measured.update(backend=backend, world=world, sizes=sizes, iters=cfg.iters)
    ctx.progress(f"collective: {backend}, {world} ranks, up to {human_bytes(largest)}")
    reports, problems = run_ranks(ctx, backend, world, sizes, cfg)
    for problem in problems:
        result.fail(problem)
    checks: dict[tuple[str, int], dict[str, Any]] = {}
    for rep in sorted(reports, key=lambda r: r["rank"]):
        for c in rep["checks"]:
            agg = checks.setdefault(
                (c["op"], c["bytes"]), {"op": c["op"], "bytes": c["bytes"], "ranks": 0, "wrong": 0}
            )
            agg["ranks"] += 1
            agg["wrong"] += c["wrong"]
            if c["wrong"]:
                result.fail(
                    f"rank {rep['rank']} ({rep['device']}): {c['op']} of {human_bytes(c['bytes'])}: "
                    f"{c['wrong']} wrong element(s)"
                )
    # every element of every rank's result compared with the known answer
    result.measured["checks"] = list(checks.values())
    result.measured["bandwidth"] = _slowest(reports)
    ar = result.measured["bandwidth"].get("all_reduce")
    if cfg.expected_busbw_gbps is not None and ar is not None and world > 1:
        floor = cfg.expected_busbw_gbps * cfg.min_fraction
        if ar["busbw_gbps"] < floor:
            result.fail(
                f"all_reduce bus bandwidth {ar['busbw_gbps']:.1f} GB/s < {floor:.1f} "
                f"({cfg.min_fraction:g} x the expected {cfg.expected_busbw_gbps:g})"
            )


def _slowest(reports: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per operation, the slowest rank's figures (a collective is as fast as its slowest rank)."""
    out: dict[str, dict[str, Any]] = {}
    for rep in reports:
        for bw in rep["bandwidth"]:
            prior = out.get(bw["op"])
            if prior is None or bw["busbw_gbps"] < prior["busbw_gbps"]:
                out[bw["op"]] = {k: v for k, v in bw.items() if k != "op"} | {"rank": rep["rank"]}
    return out
