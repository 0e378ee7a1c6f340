"""Hypothesis strategies that build valid instances of any schema dataclass.

Derived from the same type hints and ``bounds`` metadata the codec validates against, so a new
event type gets round-trip coverage without new test code.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, Union

from hypothesis import strategies as st

_JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(2**31), 2**31), st.text(max_size=10))
_JSON = st.recursive(
    _JSON_LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


def _number(tp: type, meta: dict[str, Any]) -> st.SearchStrategy[Any]:
    lo, hi = meta.get("lo"), meta.get("hi")
    if tp is int:
        return st.integers(int(lo) if lo is not None else -(2**40), int(hi) if hi is not None else 2**40)
    base = st.floats(lo if lo is not None else -1e12, hi if hi is not None else 1e12, allow_nan=False)
    if meta.get("allow_nan"):
        base = base | st.sampled_from([float("nan"), float("inf")])
    return base


def strategy_for(tp: Any, meta: dict[str, Any] | None = None) -> st.SearchStrategy[Any]:
    meta = meta or {}
    origin = typing.get_origin(tp)
    if tp is Any:
        return _JSON
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return st.none() | strategy_for(inner[0], meta)
    if tp is bool:
        return st.booleans()
    if tp in (int, float):
        return _number(tp, meta)
    if tp is str:
        return st.text(max_size=min(meta.get("max_len") or 30, 30))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if origin is list:
        return st.lists(strategy_for(typing.get_args(tp)[0], meta), max_size=3)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), strategy_for(typing.get_args(tp)[1], meta), max_size=3)
    if dataclasses.is_dataclass(tp):
        return dataclass_strategy(tp)
    raise TypeError(f"no strategy for {tp!r}")


def dataclass_strategy(cls: type) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls)
    fields = {
        f.name: strategy_for(hints[f.name], dict(f.metadata)) for f in dataclasses.fields(cls) if f.init
    }
    return st.builds(cls, **fields)
