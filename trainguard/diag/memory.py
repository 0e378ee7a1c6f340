"""``memory``: a GPU memory pattern test -- write patterns into a large buffer on each GPU, read them
back, count the 32-bit words that differ.

The patterns are the classic memtest set: all zeros and all ones, alternating bits (0xAAAAAAAA,
0x55555555, 0xCCCCCCCC, 0x33333333), walking ones (each of the 32 bits alone), each word's own
index and its complement (a fault in the address lines shows up as one word reading another's
value) and seeded random words (regenerated chunk by chunk for the check).  Every GPU gets the
same pass at once (kernels are queued on each device before waiting for any), and passes repeat
until ``duration_s`` has passed.  The buffer is ``size_mib`` per GPU, capped at
``max_free_fraction`` of the GPU's free memory, and freed (with PyTorch's cache) afterwards so
the next test finds the memory free.

Without a GPU the test is skipped.  The pattern functions take any tensor, so the unit tests run
them on the CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from trainguard.diag.base import DiagContext, DiagResult, Skipped, register
from trainguard.diag.config import MemoryConfig
from trainguard.diag.devices import cuda_devices, load_torch

MIB = 1 << 20
#: words checked (and, for the index and random patterns, generated) per kernel: bounds the
#: temporaries at a few hundred MiB whatever the buffer size.
CHUNK_WORDS = 16 << 20


def _i32(value: int) -> int:
    """An unsigned 32-bit pattern as the signed value an int32 tensor holds."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


@dataclass(frozen=True)
class Pattern:
    """``kind``: "fill" (every word ``value``), "index" (each word its index, complemented when
    ``value`` is 1) or "random" (seeded words, ``value`` the seed)."""

    name: str
    kind: str
    value: int = 0


def patterns(seed: int) -> list[Pattern]:
    """One pass's patterns, in order."""
    fills = [("zeros", 0), ("ones", 0xFFFFFFFF)]
    fills += [(f"0x{v:08X}", v) for v in (0xAAAAAAAA, 0x55555555, 0xCCCCCCCC, 0x33333333)]
    out = [Pattern(name, "fill", _i32(v)) for name, v in fills]
    out += [Pattern(f"walking_one_{bit}", "fill", _i32(1 << bit)) for bit in range(32)]
    out += [Pattern("index", "index", 0), Pattern("index_inverted", "index", 1)]
    out.append(Pattern("random", "random", seed))
    return out


def _chunks(n: int) -> range:
    return range(0, n, CHUNK_WORDS)


def _expected(torch: Any, p: Pattern, start: int, stop: int, device: Any) -> Any:
    """The words ``[start, stop)`` of a generated pattern."""
    if p.kind == "index":
        # int64 then wrapped to int32: a buffer past 2**31 words still gets distinct neighbours.
        words = torch.arange(start, stop, dtype=torch.int64, device=device)
        if p.value:
            words = ~words
        return words.to(torch.int32)
    gen = torch.Generator(device=device).manual_seed(p.value * 1_000_003 + start // CHUNK_WORDS)
    return torch.randint(
        -(1 << 31), (1 << 31) - 1, (stop - start,), generator=gen, dtype=torch.int32, device=device
    )


def write_pattern(torch: Any, buf: Any, p: Pattern) -> None:
    """Write pattern ``p`` over the whole int32 buffer ``buf``."""
    if p.kind == "fill":
        buf.fill_(p.value)
        return
    n = buf.numel()
    for start in _chunks(n):
        stop = min(n, start + CHUNK_WORDS)
        buf[start:stop].copy_(_expected(torch, p, start, stop, buf.device))


def count_mismatches(torch: Any, buf: Any, p: Pattern) -> Any:
    """Words of ``buf`` that differ from pattern ``p``: a 0-d tensor on the buffer's device (no
    host sync, so every GPU's check can be queued before any is awaited)."""
    n = buf.numel()
    total = torch.zeros((), dtype=torch.int64, device=buf.device)
    for start in _chunks(n):
        stop = min(n, start + CHUNK_WORDS)
        chunk = buf[start:stop]
        want = p.value if p.kind == "fill" else _expected(torch, p, start, stop, buf.device)
        total += (chunk != want).sum()
    return total


@register("memory", "GPU memory pattern test: write, read back, count the words that differ")
def run(ctx: DiagContext, result: DiagResult) -> None:
    cfg: MemoryConfig = ctx.section("memory")
    result.thresholds = {"max_mismatches": cfg.max_mismatches}
    torch = load_torch("memory")
    gpus = cuda_devices(torch)
    if not gpus:
        raise Skipped("no CUDA device: the memory pattern test needs a GPU")
    bufs: dict[int, Any] = {}
    per_gpu: list[dict[str, Any]] = []
    try:
        for i in range(gpus):
            free, total = torch.cuda.mem_get_info(i)
            want = cfg.size_mib * MIB
            size = min(want, int(free * cfg.max_free_fraction)) // 4 * 4
            bufs[i] = torch.empty(size // 4, dtype=torch.int32, device=f"cuda:{i}")
            per_gpu.append(
                {"device": f"cuda:{i}", "bytes": size, "free_bytes": int(free), "total_bytes": int(total)}
            )
            if size < want:
                per_gpu[-1]["note"] = f"capped at {cfg.max_free_fraction:g} of the free memory"
        by_pattern: dict[int, dict[str, int]] = {i: {} for i in bufs}
        passes = 0
        started = time.monotonic()
        ctx.progress(f"memory: {gpus} GPU(s), {cfg.size_mib} MiB each, {cfg.duration_s:g} s")
        while True:
            for p in patterns(cfg.seed + passes):
                # Queue the write and the check on every GPU, then wait: the GPUs work at once.
                counts = {}
                for i, buf in bufs.items():
                    write_pattern(torch, buf, p)
                    counts[i] = count_mismatches(torch, buf, p)
                for i, c in counts.items():
                    wrong = int(c.item())
                    if wrong:
                        by_pattern[i][p.name] = by_pattern[i].get(p.name, 0) + wrong
            passes += 1
            if time.monotonic() - started >= cfg.duration_s:
                break
        elapsed = time.monotonic() - started
    finally:
        bufs.clear()
        torch.cuda.empty_cache()  # give the memory back: the collective's ranks need it next
    n_patterns = len(patterns(0))
    for i, entry in enumerate(per_gpu):
        wrong = sum(by_pattern[i].values())
        # each pattern writes every byte once and reads it once
        moved = 2 * entry["bytes"] * n_patterns * passes
        entry.update(
            mismatches=wrong,
            mismatches_by_pattern=by_pattern[i],
            bandwidth_gbps=round(moved / elapsed / 1e9, 1) if elapsed > 0 else None,
        )
        if wrong > cfg.max_mismatches:
            worst = ", ".join(
                f"{k}: {v}" for k, v in sorted(by_pattern[i].items(), key=lambda kv: -kv[1])[:5]
            )
            result.fail(
                f"{entry['device']}: {wrong} word(s) read back wrong > {cfg.max_mismatches} ({worst})"
            )
    result.measured.update(passes=passes, patterns=n_patterns, seconds=round(elapsed, 3), gpus=per_gpu)
