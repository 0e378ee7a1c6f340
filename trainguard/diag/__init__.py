"""Node diagnostics: named tests of one machine's GPUs, memory, interconnect and DCGM, each
returning one JSON result (``trainguard diag``; ByteRobust's stop-time checks before a machine
rejoins a job).

Tests, one file each, registered by name (:mod:`trainguard.diag.base`):

* ``gpu-health`` -- NVML error counters, row remapping, throttling, Xid events;
* ``gemm-digest`` -- the same matrix-product chain on every device, its sha256 compared
  (silent data corruption);
* ``memory`` -- GPU memory pattern test;
* ``collective`` -- all-reduce and all-gather among the node's devices, every element checked;
* ``dcgm`` / ``nccl-tests`` -- ``dcgmi diag`` and ``all_reduce_perf`` when installed, parsed.

Levels (:data:`~trainguard.diag.config.LEVEL_TESTS`) choose the tests and their sizes: ``quick``
(~30 s), ``standard`` (minutes), ``long``.  PyTorch and pynvml are imported inside the tests
only: importing this package needs neither.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

# Importing the test modules registers them (alphabetical: the order `--list` shows).
from trainguard.diag import collective, dcgm, gemm_digest, gpu_health, memory, nccl_tests  # noqa: F401
from trainguard.diag.base import REGISTRY, DiagContext, DiagResult, Skipped, register, run_test
from trainguard.diag.config import LEVEL_TESTS, LEVELS, DiagConfig, load_diag_config

__all__ = [
    "LEVELS",
    "LEVEL_TESTS",
    "REGISTRY",
    "DiagConfig",
    "DiagContext",
    "DiagResult",
    "Skipped",
    "load_diag_config",
    "register",
    "run_test",
    "run_tests",
]


def run_tests(names: Iterable[str], ctx: DiagContext) -> Iterator[DiagResult]:
    """Run the named tests in order, yielding each result as it is known (for streaming output)."""
    for name in names:
        if name not in REGISTRY:
            raise KeyError(f"unknown diag test {name!r} (known: {', '.join(REGISTRY)})")
        ctx.progress(f"diag: {name} ...")
        yield run_test(name, ctx)
