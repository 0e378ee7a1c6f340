"""Code version ``v2-buggy``: a "fused GELU" push with a real bug (a bool where torch wants a str).

It raises ``TypeError: gelu(): argument 'approximate' must be str, not bool`` from the forward, so
the rank's traceback names this module as the last user frame -- the rollback signal.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def activation(x: torch.Tensor) -> torch.Tensor:
    fast: Any = True  # the bug: the new kernel's flag passed straight through to torch
    return F.gelu(x, approximate=fast)
