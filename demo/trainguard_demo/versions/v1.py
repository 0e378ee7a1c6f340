"""Code version ``v1``: the tanh-approximated GELU of GPT-2."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def activation(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")
