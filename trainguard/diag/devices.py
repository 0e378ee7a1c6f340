"""Lazy access to PyTorch and NVML for the diag tests, and the node's GPU count.

Neither is imported at module level anywhere in :mod:`trainguard.diag`: ``trainguard diag --list``
and every test that does not need them run without them, and a node without PyTorch gets its
torch tests *skipped* with that reason instead of a command that does not start.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from trainguard.diag.base import Skipped

#: NVML return codes (nvml.h; stable across driver versions).
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
#: cuBLAS needs this set before its first handle for deterministic results on several streams, and
#: PyTorch's deterministic mode refuses CUDA matrix products without it (":4096:8" is what the
#: PyTorch reproducibility notes give).
CUBLAS_WORKSPACE = ":4096:8"


def load_torch(test: str) -> Any:
    """``import torch``, or :class:`Skipped` saying that ``test`` needs it."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    try:
        import torch
    except ImportError as exc:
        raise Skipped(f"torch is not installed ({exc}); {test} needs PyTorch") from None
    return torch


def load_pynvml() -> Any:
    """The ``pynvml`` module (from nvidia-ml-py); ImportError when absent."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated PyPI shim warns; same API
        import pynvml

    return pynvml


def nvml_code(exc: BaseException) -> int | None:
    """The NVML return code of a pynvml exception (None for anything else)."""
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def cuda_devices(torch: Any) -> int:
    """CUDA devices PyTorch can use (0 without CUDA, or with a CPU-only build)."""
    try:
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:  # a broken driver install: no usable GPU, which the tests report
        return 0


def gpu_count(nvml: Any = None) -> int:
    """GPUs of this node by NVML, else by PyTorch, else 0 (for tools that take a GPU count)."""
    try:
        lib = nvml if nvml is not None else load_pynvml()
        lib.nvmlInit()
        try:
            return int(lib.nvmlDeviceGetCount())
        finally:
            lib.nvmlShutdown()
    except Exception:
        pass
    try:
        import torch
    except ImportError:
        return 0
    return cuda_devices(torch)


@contextmanager
def deterministic(torch: Any) -> Iterator[None]:
    """PyTorch set for bit-reproducible results at full precision, restored afterwards.

    Deterministic algorithms, no cuDNN autotuning, no TF32 and no reduced-precision reductions:
    a digest must depend on the inputs and the hardware only, never on an autotuner's pick or
    on a global default another caller changed.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    matmul = torch.backends.cuda.matmul
    saved = {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "precision": torch.get_float32_matmul_precision(),
        "tf32": matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "fp16_reduced": matmul.allow_fp16_reduced_precision_reduction,
        "bf16_reduced": matmul.allow_bf16_reduced_precision_reduction,
    }
    torch.use_deterministic_algorithms(True)
    torch.set_float32_matmul_precision("highest")
    matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    matmul.allow_fp16_reduced_precision_reduction = False
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved["deterministic"])
        torch.set_float32_matmul_precision(saved["precision"])
        matmul.allow_tf32 = saved["tf32"]
        torch.backends.cudnn.allow_tf32 = saved["cudnn_tf32"]
        torch.backends.cudnn.benchmark = saved["benchmark"]
        torch.backends.cudnn.deterministic = saved["cudnn_deterministic"]
        matmul.allow_fp16_reduced_precision_reduction = saved["fp16_reduced"]
        matmul.allow_bf16_reduced_precision_reduction = saved["bf16_reduced"]
