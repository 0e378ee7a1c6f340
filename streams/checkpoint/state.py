"""The host-memory snapshot of a rank's training state, and its (de)serialization.

:func:`snapshot_into` copies model, optimizer and data position into CPU tensors reused from
the snapshot before last (ByteRobust's dual buffer: the writer thread serializes one while the
loop fills the other), so a step allocates nothing once the buffers exist.  Torch is taken from
``sys.modules``: a process that checkpoints a torch model has imported it, and this package
must not import it (the training API stays importable without torch).
"""

from __future__ import annotations

import copy
import io
import sys
from typing import Any


def torch_module() -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        raise RuntimeError("torch is not imported: checkpoints hold torch state; import torch first")
    return torch


def snapshot_into(src: Any, prev: Any, tensor_type: Any) -> Any:
    """A private CPU copy of ``src`` (nested dicts, lists, tuples, tensors), reusing ``prev``'s tensors.

    The copy must be private: the optimizer step that follows mutates the live tensors in place.
    """
    if isinstance(src, tensor_type):
        t = src.detach()
        if (
            isinstance(prev, tensor_type)
            and prev.shape == t.shape
            and prev.dtype == t.dtype
            and prev.device.type == "cpu"
        ):
            return prev.copy_(t)
        return t.to("cpu", copy=True)
    if isinstance(src, dict):
        old = prev if isinstance(prev, dict) else {}
        return {k: snapshot_into(v, old.get(k), tensor_type) for k, v in src.items()}
    if isinstance(src, list | tuple):
        p = prev if isinstance(prev, list | tuple) and len(prev) == len(src) else [None] * len(src)
        out = [snapshot_into(v, q, tensor_type) for v, q in zip(src, p, strict=True)]
        return out if isinstance(src, list) else tuple(out)
    return copy.deepcopy(src)


def serialize(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch_module().save(state, buf)
    return buf.getvalue()


def deserialize(data: bytes) -> dict[str, Any]:
    # weights_only: a shard is data (tensors, numbers, strings), never code, even from a peer.
    state = torch_module().load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError("not a TrainGuard checkpoint shard")
    return state
