"""The host-memory snapshot of a rank's training state, and its shard format.

:func:`snapshot_into` copies model, optimizer and data position into CPU tensors reused from
the snapshot before last (ByteRobust's dual buffer: the writer thread writes and sends one
while the loop fills the other), so a step allocates nothing once the buffers exist.

:func:`encode` turns a snapshot into a shard without serializing tensors: a JSON description
(nested dicts, lists, numbers, strings; each tensor's dtype, shape and offset) followed by the
tensors' raw bytes, handed out as zero-copy views of the snapshot's own memory.  ``torch.save``
pickles and zips the same state at about half a gigabyte a second, a cost paid every step on
the CPU a rank shares with its data loader; a view costs nothing, and a shard holds no code to
run on load.  Torch is taken from ``sys.modules``: a process that checkpoints a torch model has
imported it, and this package must not import it (the training API stays importable without it).
"""

from __future__ import annotations

import ctypes
import json
import struct
import sys
from typing import Any

MAGIC = b"TGCK1\n"
_META_LEN = struct.Struct(">Q")


def torch_module() -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        raise RuntimeError("torch is not imported: checkpoints hold torch state; import torch first")
    return torch


def snapshot_into(src: Any, prev: Any, tensor_type: Any) -> Any:
    """A private, contiguous CPU copy of ``src`` (nested dicts, lists, tuples, tensors), reusing
    ``prev``'s tensors.  Private: the optimizer step that follows mutates the live tensors."""
    if isinstance(src, tensor_type):
        t = src.detach()
        if isinstance(prev, tensor_type) and prev.shape == t.shape and prev.dtype == t.dtype:
            return prev.copy_(t)  # prev was made contiguous on the CPU below
        return t.to("cpu", copy=True).contiguous()
    if isinstance(src, dict):
        old = prev if isinstance(prev, dict) else {}
        return {k: snapshot_into(v, old.get(k), tensor_type) for k, v in src.items()}
    if isinstance(src, list | tuple):
        p = prev if isinstance(prev, list | tuple) and len(prev) == len(src) else [None] * len(src)
        out = [snapshot_into(v, q, tensor_type) for v, q in zip(src, p, strict=True)]
        return out if isinstance(src, list) else tuple(out)
    if src is None or isinstance(src, bool | int | float | str):
        return src
    raise TypeError(
        f"a checkpoint holds tensors, numbers, strings, lists and dicts, not {type(src).__name__}"
    )


def encode(snapshot: Any, tensor_type: Any) -> list[bytes | memoryview]:
    """The shard's parts: header, JSON description, then each tensor's bytes (views, not copies).

    The views point into ``snapshot``'s tensors: they stay valid while the snapshot is not refilled.
    """
    views: list[memoryview] = []
    offset = 0

    def walk(x: Any) -> Any:
        nonlocal offset
        if isinstance(x, tensor_type):
            n = x.numel() * x.element_size()
            if n:
                views.append(memoryview((ctypes.c_char * n).from_address(x.data_ptr())).cast("B"))
            out = {"t": str(x.dtype).removeprefix("torch."), "shape": list(x.shape), "at": offset, "n": n}
            offset += n
            return out
        if isinstance(x, dict):
            return {"d": [[walk(k), walk(v)] for k, v in x.items()]}
        if isinstance(x, list | tuple):
            return {"l" if isinstance(x, list) else "u": [walk(v) for v in x]}
        return {"v": x}

    meta = json.dumps(walk(snapshot)).encode()
    return [MAGIC + _META_LEN.pack(len(meta)), meta, *views]


def decode(data: bytes | bytearray) -> dict[str, Any]:
    """The training state of a shard (a :class:`ValueError` for anything malformed: a shard may
    come from a peer, so every offset and dtype is checked before it is used)."""
    torch = torch_module()
    head = len(MAGIC) + _META_LEN.size
    if data[: len(MAGIC)] != MAGIC or len(data) < head:
        raise ValueError("not a TrainGuard checkpoint shard")
    (meta_len,) = _META_LEN.unpack(data[len(MAGIC) : head])
    if head + meta_len > len(data):
        raise ValueError("shard description runs past the end of the shard")
    raw = memoryview(bytearray(data[head + meta_len :]))  # writable: torch.frombuffer wants one

    def build(node: Any) -> Any:
        if not isinstance(node, dict) or len(node) not in (1, 4):
            raise ValueError(f"malformed shard node {str(node)[:80]!r}")
        if "t" in node:
            dtype = getattr(torch, str(node["t"]), None)
            shape, at, n = node["shape"], node["at"], node["n"]
            if not isinstance(dtype, torch.dtype) or not all(
                type(v) is int and v >= 0 for v in [*shape, at, n]
            ):
                raise ValueError(f"malformed tensor in shard: {str(node)[:120]!r}")
            count = 1
            for s in shape:
                count *= s
            if count * dtype.itemsize != n or at + n > len(raw):
                raise ValueError("tensor size does not match its bytes in the shard")
            if n == 0:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(raw, dtype=dtype, count=count, offset=at).reshape(shape)
        (kind, value), *_ = node.items()
        if kind == "d":
            return {_key(build(k)): build(v) for k, v in value}
        if kind in ("l", "u"):
            items = [build(v) for v in value]
            return items if kind == "l" else tuple(items)
        if kind == "v" and (value is None or isinstance(value, bool | int | float | str)):
            return value
        raise ValueError(f"malformed shard node {str(node)[:80]!r}")

    state = build(json.loads(data[len(MAGIC) + _META_LEN.size : head + meta_len]))
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError("not a TrainGuard checkpoint shard")
    return state


def _key(k: Any) -> Any:
    if isinstance(k, bool | int | str):
        return k
    raise ValueError(f"a shard's dict key must be a string or an integer, not {k!r}")
