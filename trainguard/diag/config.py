"""``trainguard diag``'s one config dataclass (``DiagConfig``), one nested section per test.

Loaded like every TrainGuard component (:mod:`trainguard.schemas.config`), with one layer more at
the bottom: the dataclass defaults, then the **level**'s preset (:data:`LEVELS`: sizes and
durations for ``quick``, ``standard``, ``long``), then a YAML mapping (``--diag-config FILE``),
then environment variables ``TRAINGUARD_DIAG__<SECTION>__<KEY>`` (e.g.
``TRAINGUARD_DIAG__MEMORY__SIZE_MIB=512``), then the command's ``--set SECTION.KEY=VALUE`` flags.
Unknown keys anywhere are errors.  Section names are the test names with ``_`` for ``-``
(``gemm_digest`` for ``gemm-digest``).

Thresholds are ``int | None`` or ``float | None`` where ``None`` means "recorded, not checked":
the defaults check what is unambiguous (an uncorrectable ECC error since boot, a pending row
remap, a hardware slowdown, a wrong element) and leave hardware-specific figures (bandwidth,
TFLOPS) to the site's own expected values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainguard.schemas.config import ConfigError, deep_merge, load_config
from trainguard.schemas.typecheck import bounds

ENV_PREFIX = "TRAINGUARD_DIAG"
_COUNT = bounds(0, 2**63)
_SECONDS = bounds(0, 86_400)
#: the dtypes gemm-digest accepts (names of ``torch.<dtype>``).
GEMM_DTYPES = ("float32", "float64", "float16", "bfloat16")


def section_name(test: str) -> str:
    """The config section of a test name (``gemm-digest`` -> ``gemm_digest``)."""
    return test.replace("-", "_")


@dataclass(frozen=True)
class GpuHealthConfig:
    """``gpu-health``: NVML's error counters and states against limits, and Xid events."""

    #: how long to wait for Xid events (NVML event API) after the counters are read.
    xid_window_s: float = field(default=2.0, metadata=bounds(0, 3600))
    #: Xid events (not in ``ignore_xids``) tolerated in the window.
    max_xid_events: int = field(default=0, metadata=_COUNT)
    #: Xids that are an application's doing, not the node's (13, 31, 43: a kernel's own fault).
    ignore_xids: list[int] = field(default_factory=lambda: [13, 31, 43], metadata=bounds(0, 10_000))
    #: uncorrectable ECC errors since the driver loaded (volatile) / over the board's life.
    max_ecc_volatile_uncorrected: int | None = field(default=0, metadata=_COUNT)
    max_ecc_aggregate_uncorrected: int | None = field(default=None, metadata=_COUNT)
    #: retired pages, both causes (boards before Ampere retire pages; later ones remap rows):
    #: failing from 60 by default -- set your vendor's replacement figure.
    max_retired_pages: int | None = field(default=59, metadata=_COUNT)
    #: a page waiting for retirement, a row waiting for a remap: both need a GPU reset first.
    fail_on_retirement_pending: bool = True
    fail_on_remap_pending: bool = True
    #: a row remap that failed (no spare rows left in a bank): the board is due for RMA.
    fail_on_remap_failure: bool = True
    max_remapped_rows_uncorrectable: int | None = field(default=None, metadata=_COUNT)
    #: PCIe replays since the driver loaded (a healthy link stays near 0).
    max_pcie_replays: int | None = field(default=None, metadata=_COUNT)
    #: NVLink error counters (replay, recovery, CRC flit, CRC data) summed over the links.
    max_nvlink_errors: int | None = field(default=None, metadata=_COUNT)
    #: clocks-event (throttle) reasons that fail the test when set (names of
    #: :data:`trainguard.schemas.telemetry.THROTTLE_BITS`); power caps and idle are normal.
    fail_throttle_reasons: list[str] = field(
        default_factory=lambda: ["hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"],
        metadata=bounds(max_len=64, max_items=32),
    )
    #: GPUs this node should have (0: whatever NVML finds).
    expect_gpus: int = field(default=0, metadata=bounds(0, 1024))


@dataclass(frozen=True)
class GemmDigestConfig:
    """``gemm-digest``: a fixed chain of matrix products per device and the digest of its result."""

    #: matrix side on a GPU, and on the CPU when the node has none (a CPU is ~100x slower).
    size: int = field(default=2048, metadata=bounds(16, 65_536))
    cpu_size: int = field(default=384, metadata=bounds(16, 16_384))
    #: products in the chain (x <- tanh(x @ B[i % 4])).
    chain: int = field(default=8, metadata=bounds(1, 10_000))
    #: chains run per device; every repeat must give the same digest.
    repeats: int = field(default=2, metadata=bounds(1, 10_000))
    dtype: str = "float32"
    seed: int = field(default=20_251_127, metadata=bounds(0, 2**63))
    #: the sha256 every device must produce ("": none).
    expected_digest: str = field(default="", metadata=bounds(max_len=64))
    #: a file of expected digests: one hex digest, or a JSON object recipe -> digest (the recipe
    #: is in each device's ``measured`` entry).
    expected_file: str = ""
    #: devices of the same model must agree with each other.
    compare_devices: bool = True
    #: slowest acceptable device (None: not checked).
    min_tflops: float | None = field(default=None, metadata=bounds(0, 1e6))

    def __post_init__(self) -> None:
        if self.dtype not in GEMM_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(GEMM_DTYPES)}, not {self.dtype!r}")
        digest = self.expected_digest.lower()
        if digest and (len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest)):
            raise ValueError("expected_digest must be a sha256 in hex (64 characters)")


@dataclass(frozen=True)
class MemoryConfig:
    """``memory``: write patterns to GPU memory, read them back, count the words that differ."""

    #: buffer per GPU; capped at ``max_free_fraction`` of the GPU's free memory.
    size_mib: int = field(default=1024, metadata=bounds(1, 1 << 24))
    max_free_fraction: float = field(default=0.8, metadata=bounds(0.01, 0.95))
    #: keep repeating the pattern passes this long (at least one pass).
    duration_s: float = field(default=10.0, metadata=_SECONDS)
    max_mismatches: int = field(default=0, metadata=_COUNT)
    seed: int = field(default=7, metadata=bounds(0, 2**63))


@dataclass(frozen=True)
class CollectiveConfig:
    """``collective``: all-reduce and all-gather among the node's devices, every element checked."""

    #: "auto": NCCL among the GPUs when there are 2 or more, else gloo among CPU processes;
    #: "nccl" also runs on one GPU (a single rank: its kernels checked, no bandwidth).
    backend: str = "auto"
    #: processes of the gloo (CPU) run.
    cpu_procs: int = field(default=2, metadata=bounds(2, 64))
    #: the largest tensor per rank (a 64 KiB one is always checked too); the CPU's own limit.
    max_mib: int = field(default=64, metadata=bounds(1, 1 << 20))
    cpu_max_mib: int = field(default=4, metadata=bounds(1, 4096))
    #: timed iterations of each operation on the largest tensor.
    iters: int = field(default=5, metadata=bounds(1, 100_000))
    #: the all-reduce bus bandwidth this node should reach (GB/s, nccl-tests' busbw; None: not
    #: checked), and the fraction of it that still passes.
    expected_busbw_gbps: float | None = field(default=None, metadata=bounds(0, 1e6))
    min_fraction: float = field(default=0.8, metadata=bounds(0, 1))
    timeout_s: float = field(default=180.0, metadata=bounds(0.1, 86_400))

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"backend must be auto, nccl or gloo, not {self.backend!r}")


@dataclass(frozen=True)
class DcgmConfig:
    """``dcgm``: ``dcgmi diag -r LEVEL`` when DCGM is installed, its table parsed."""

    binary: str = "dcgmi"
    run_level: int = field(default=1, metadata=bounds(1, 4))
    timeout_s: float = field(default=300.0, metadata=bounds(0.1, 86_400))
    #: a "Warn" result fails the test too.
    fail_on_warn: bool = False


@dataclass(frozen=True)
class NcclTestsConfig:
    """``nccl-tests``: NVIDIA's ``all_reduce_perf`` when on PATH, its table parsed."""

    binary: str = "all_reduce_perf"
    #: ``-b``/``-e``/``-f``: the sizes scanned (nccl-tests' own syntax, e.g. 8M, 1G).
    min_bytes: str = field(default="8M", metadata=bounds(max_len=32))
    max_bytes: str = field(default="1G", metadata=bounds(max_len=32))
    factor: int = field(default=2, metadata=bounds(2, 1024))
    #: ``-g``: GPUs (0: every GPU of the node).
    gpus: int = field(default=0, metadata=bounds(0, 1024))
    extra_args: list[str] = field(default_factory=list, metadata=bounds(max_len=256, max_items=64))
    expected_busbw_gbps: float | None = field(default=None, metadata=bounds(0, 1e6))
    min_fraction: float = field(default=0.8, metadata=bounds(0, 1))
    timeout_s: float = field(default=600.0, metadata=bounds(0.1, 86_400))


@dataclass(frozen=True)
class DiagConfig:
    """Every diag test's settings; see the module docstring for where values come from."""

    gpu_health: GpuHealthConfig = field(default_factory=GpuHealthConfig)
    gemm_digest: GemmDigestConfig = field(default_factory=GemmDigestConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    collective: CollectiveConfig = field(default_factory=CollectiveConfig)
    dcgm: DcgmConfig = field(default_factory=DcgmConfig)
    nccl_tests: NcclTestsConfig = field(default_factory=NcclTestsConfig)


#: the tests each level runs, in order (cheap NVML reads first: a node that fails them is not
#: worth minutes of stress).
LEVEL_TESTS: dict[str, tuple[str, ...]] = {
    # ~30 s on a GPU node (dcgmi -r 1 included when installed).
    "quick": ("gpu-health", "gemm-digest", "collective", "dcgm"),
    # a few minutes.
    "standard": ("gpu-health", "gemm-digest", "memory", "collective", "dcgm", "nccl-tests"),
    # tens of minutes: an administrator's look at a suspect node.
    "long": ("gpu-health", "gemm-digest", "memory", "collective", "dcgm", "nccl-tests"),
}

#: each level's settings over the dataclass defaults (which are ``quick``'s).
LEVELS: dict[str, dict[str, Any]] = {
    "quick": {},
    "standard": {
        "gpu_health": {"xid_window_s": 5.0},
        "gemm_digest": {"size": 4096, "chain": 16, "repeats": 3},
        "memory": {"size_mib": 4096, "duration_s": 30.0},
        "collective": {"max_mib": 512, "iters": 20, "cpu_max_mib": 16},
        "dcgm": {"run_level": 2, "timeout_s": 900.0},
        "nccl_tests": {"max_bytes": "2G"},
    },
    "long": {
        "gpu_health": {"xid_window_s": 30.0},
        "gemm_digest": {"size": 8192, "chain": 32, "repeats": 10, "cpu_size": 768},
        "memory": {"size_mib": 1 << 20, "duration_s": 600.0},  # capped at max_free_fraction of free
        "collective": {"max_mib": 2048, "iters": 50, "cpu_max_mib": 64, "timeout_s": 900.0},
        "dcgm": {"run_level": 3, "timeout_s": 7200.0},
        "nccl_tests": {"min_bytes": "8", "max_bytes": "8G", "timeout_s": 1800.0},
    },
}


def load_diag_config(
    level: str = "quick",
    data: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> DiagConfig:
    """Defaults <- ``level``'s preset <- ``data`` <- ``TRAINGUARD_DIAG__*``; unknown keys raise
    :class:`ConfigError`.

    >>> load_diag_config("standard", {"memory": {"size_mib": 64}}, environ={}).memory.size_mib
    64
    >>> load_diag_config("long", environ={}).dcgm.run_level
    3
    >>> load_diag_config("quick", {"memory": {"sise_mib": 64}}, environ={})
    Traceback (most recent call last):
    ...
    trainguard.schemas.config.ConfigError: DiagConfig.memory: unknown field(s) 'sise_mib'
    """
    if level not in LEVELS:
        raise ConfigError(f"unknown diag level {level!r} (one of {', '.join(LEVELS)})")
    merged = deep_merge(LEVELS[level], data or {})
    return load_config(DiagConfig, merged, env_prefix=ENV_PREFIX, environ=environ)
