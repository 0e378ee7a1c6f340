"""``gemm-digest``: the silent-data-corruption catch -- the same chain of matrix products on every
device, and the sha256 of each result.

From a fixed seed, the inputs (one ``size x size`` matrix A and four B_k, scaled so the values stay
near 1) are drawn on the CPU, so every device starts from the same bits; then on each device
``x <- tanh(x @ B[i % 4])``, ``chain`` times, ``repeats`` times over, with PyTorch in deterministic
mode, TF32 and reduced-precision reductions off (:func:`~trainguard.diag.devices.deterministic`).
The tanh makes the chain nonlinear, so a wrong bit anywhere spreads into the digest instead of
being averaged away.

A device fails when its repeats disagree (the same device, the same inputs, two answers), when
its digest differs from the majority of the node's devices of the same model, when it differs
from an expected digest (``--expected-digest`` or a file of them by recipe), when its result is
not finite, or when it is slower than ``min_tflops``.  Digests depend on the model, the PyTorch
and CUDA versions, the sizes and the dtype -- all of them in each device's ``recipe`` string, the
key of an expected-digest file -- so compare only like with like.  Without a GPU the chain runs
on the CPU (``cpu_size``): the digest is then reproducible on that machine, which the tests use.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

from trainguard.diag.base import DiagContext, DiagResult, register
from trainguard.diag.config import GemmDigestConfig
from trainguard.diag.devices import cuda_devices, deterministic, load_torch

#: distinct B matrices cycled through the chain (the memory of a long chain stays 5 matrices).
N_FACTORS = 4


def tensor_digest(torch: Any, t: Any) -> str:
    """sha256 of a tensor's bytes (copied to the CPU; no numpy needed)."""
    host = t.detach().to("cpu").contiguous()
    return hashlib.sha256(ctypes.string_at(host.data_ptr(), host.numel() * host.element_size())).hexdigest()


def make_inputs(torch: Any, n: int, seed: int, dtype: Any) -> tuple[Any, list[Any]]:
    """The chain's inputs, drawn on the CPU from ``seed`` (identical bits for every device)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(n, n, generator=gen, dtype=torch.float32)
    # 1/sqrt(n): a product of two N(0,1) matrices has entries of variance n; this keeps them ~1.
    bs = [torch.randn(n, n, generator=gen, dtype=torch.float32) / math.sqrt(n) for _ in range(N_FACTORS)]
    return a.to(dtype), [b.to(dtype) for b in bs]


def run_chain(torch: Any, a: Any, bs: list[Any], chain: int) -> Any:
    x = a
    for i in range(chain):
        x = torch.tanh(x @ bs[i % len(bs)])
    return x


def device_digests(
    torch: Any, device: str, n: int, cfg: GemmDigestConfig, inputs: tuple[Any, list[Any]]
) -> dict[str, Any]:
    """Run the chain ``cfg.repeats`` times on ``device``: its digests, timing and finiteness."""
    a, bs = inputs[0].to(device), [b.to(device) for b in inputs[1]]
    digests: list[str] = []
    seconds: list[float] = []
    finite = True
    for _ in range(cfg.repeats):
        _sync(torch, device)
        t0 = time.perf_counter()
        x = run_chain(torch, a, bs, cfg.chain)
        _sync(torch, device)
        seconds.append(time.perf_counter() - t0)
        finite = finite and bool(torch.isfinite(x).all())
        digests.append(tensor_digest(torch, x))
    best = min(seconds)
    flops = 2.0 * n**3 * cfg.chain
    return {
        "device": device,
        "digest": digests[0],
        "repeats_agree": len(set(digests)) == 1,
        "distinct_digests": sorted(set(digests)),
        "finite": finite,
        "seconds_best": round(best, 6),
        "tflops": round(flops / best / 1e12, 3) if best > 0 else None,
    }


def _sync(torch: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def load_expected(path: str) -> dict[str, str] | str:
    """An expected-digest file: a JSON object recipe -> digest, or one hex digest (its first word)."""
    text = Path(path).read_text(encoding="utf-8").strip()
    if text.startswith("{"):
        data = json.loads(text)
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ValueError(f"{path}: expected a JSON object of recipe -> sha256 digest")
        return {str(k): v.lower() for k, v in data.items()}
    return text.split()[0].lower() if text else ""


def majority_outliers(digests: dict[str, str]) -> list[str]:
    """Devices whose digest is not the one most of them share (all of them on a tie).

    >>> majority_outliers({"cuda:0": "a", "cuda:1": "a", "cuda:2": "b"})
    ['cuda:2']
    >>> majority_outliers({"cuda:0": "a", "cuda:1": "b"})
    ['cuda:0', 'cuda:1']
    >>> majority_outliers({"cuda:0": "a"})
    []
    """
    counts = Counter(digests.values()).most_common()
    if len(counts) <= 1:
        return []
    if counts[0][1] == counts[1][1]:
        return sorted(digests)
    return sorted(d for d, v in digests.items() if v != counts[0][0])


@register("gemm-digest", "a fixed chain of matrix products per device; its sha256 must agree")
def run(ctx: DiagContext, result: DiagResult) -> None:
    cfg: GemmDigestConfig = ctx.section("gemm-digest")
    result.thresholds = {
        "expected_digest": cfg.expected_digest.lower() or None,
        "expected_file": cfg.expected_file or None,
        "compare_devices": cfg.compare_devices,
        "min_tflops": cfg.min_tflops,
    }
    torch = load_torch("gemm-digest")
    gpus = cuda_devices(torch)
    devices = [f"cuda:{i}" for i in range(gpus)] or ["cpu"]
    n = cfg.size if gpus else cfg.cpu_size
    dtype = getattr(torch, cfg.dtype)
    expected_file = load_expected(cfg.expected_file) if cfg.expected_file else None
    result.measured.update(
        size=n, chain=cfg.chain, repeats=cfg.repeats, dtype=cfg.dtype, seed=cfg.seed, devices=[]
    )
    with deterministic(torch):
        inputs = make_inputs(torch, n, cfg.seed, dtype)
        for device in devices:
            ctx.progress(f"gemm-digest: {device}, {cfg.repeats} x {cfg.chain} products of {n}x{n}")
            name = _device_name(torch, device)
            entry = {"name": name, "recipe": _recipe(torch, name, n, cfg)}
            try:
                entry.update(device_digests(torch, device, n, cfg, inputs))
            except Exception as exc:  # one device's CUDA error must not hide the others' digests
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
            result.measured["devices"].append(entry)
    _check(cfg, result, expected_file)


def _check(cfg: GemmDigestConfig, result: DiagResult, expected_file: dict[str, str] | str | None) -> None:
    entries: list[dict[str, Any]] = result.measured["devices"]
    ran = [e for e in entries if "digest" in e]
    for e in entries:
        if "error" in e:
            result.fail(f"{e['device']}: the chain failed: {e['error']}")
    for e in ran:
        dev = e["device"]
        if not e["repeats_agree"]:
            result.fail(
                f"{dev}: {len(e['distinct_digests'])} different digests from {cfg.repeats} identical runs"
            )
        if not e["finite"]:
            result.fail(f"{dev}: the result holds NaN or Inf")
        if cfg.min_tflops is not None and e["tflops"] is not None and e["tflops"] < cfg.min_tflops:
            result.fail(f"{dev}: {e['tflops']} TFLOPS < {cfg.min_tflops} (min_tflops)")
        want = cfg.expected_digest.lower()
        if want and e["digest"] != want:
            result.fail(f"{dev}: digest {e['digest'][:16]}... differs from the expected {want[:16]}...")
        if isinstance(expected_file, str) and expected_file and e["digest"] != expected_file:
            result.fail(f"{dev}: digest {e['digest'][:16]}... differs from {cfg.expected_file}")
        elif isinstance(expected_file, dict):
            if e["recipe"] in expected_file:
                if e["digest"] != expected_file[e["recipe"]]:
                    result.fail(f"{dev}: digest differs from {cfg.expected_file}'s for {e['recipe']}")
            else:
                e["note"] = f"no expected digest in {cfg.expected_file} for this recipe"
    if cfg.compare_devices:
        by_model: dict[str, dict[str, str]] = {}
        for e in ran:
            by_model.setdefault(e["name"], {})[e["device"]] = e["digest"]
        for model, digests in by_model.items():
            for dev in majority_outliers(digests):
                others = len(digests) - 1
                result.fail(f"{dev}: digest differs from the other {others} {model} device(s) of the node")


def _device_name(torch: Any, device: str) -> str:
    if device.startswith("cuda"):
        return str(torch.cuda.get_device_name(device))
    # CPU results may depend on the math library's thread split: the count is part of the name.
    return f"cpu ({torch.get_num_threads()} threads)"


def _recipe(torch: Any, name: str, n: int, cfg: GemmDigestConfig) -> str:
    """Everything a digest depends on besides the hardware working: the expected-file key."""
    cuda = getattr(torch.version, "cuda", None) or "none"
    return (
        f"{name}|torch {torch.__version__}|cuda {cuda}|n={n} chain={cfg.chain} "
        f"dtype={cfg.dtype} seed={cfg.seed}"
    )
