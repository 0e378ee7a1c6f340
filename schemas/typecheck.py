"""Strict conversion of decoded JSON/YAML values into typed dataclasses.

One checker serves both wire events (``schemas.codec``) and configuration files
(``schemas.config``), so "what a valid value is" is defined once.  Every failure is a
:class:`SchemaError` that names the exact path of the bad value (``gpus[3].temperature_c``),
which is what ends up in a dead-letter record or a config error message.

Supported annotations: ``int``, ``float``, ``str``, ``bool``, ``X | None``, ``list[X]``,
``tuple[X, ...]``, ``dict[str, X]``, ``Any`` (any JSON value), ``enum.Enum`` subclasses and
nested dataclasses.  Numeric ranges come from field metadata: ``field(metadata=bounds(0, 100))``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from functools import cache
from typing import Any, Union


class SchemaError(ValueError):
    """A value does not fit its schema; ``path`` locates it, ``reason`` says why."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}" if path else reason)


def bounds(
    lo: float | None = None, hi: float | None = None, *, allow_nan: bool = False, max_len: int | None = None
) -> dict[str, Any]:
    """Field metadata for range checks: inclusive ``lo``/``hi``; NaN/Inf only if ``allow_nan``."""
    return {"lo": lo, "hi": hi, "allow_nan": allow_nan, "max_len": max_len}


@cache
def _hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _check_number(value: float, meta: dict[str, Any], path: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        if not meta.get("allow_nan"):
            raise SchemaError(path, f"non-finite value {value!r} not allowed")
        return
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and value < lo:
        raise SchemaError(path, f"{value!r} is below the minimum {lo!r}")
    if hi is not None and value > hi:
        raise SchemaError(path, f"{value!r} is above the maximum {hi!r}")


def convert(value: Any, tp: Any, path: str = "", meta: dict[str, Any] | None = None) -> Any:
    """Return ``value`` converted to annotation ``tp`` or raise :class:`SchemaError`."""
    meta = meta or {}
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise SchemaError(path, "is required (got null)")
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise SchemaError(path, f"unsupported union {tp!r}")
        return convert(value, inner[0], path, meta)
    if value is None:
        raise SchemaError(path, "is required (got null)")
    if tp is bool:
        if not isinstance(value, bool):
            raise SchemaError(path, f"expected a boolean, got {type(value).__name__}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise SchemaError(path, f"expected an integer, got {type(value).__name__} {value!r:.40}")
        _check_number(value, meta, path)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SchemaError(path, f"expected a number, got {type(value).__name__} {value!r:.40}")
        value = float(value)
        _check_number(value, meta, path)
        return value
    if tp is str:
        if not isinstance(value, str):
            raise SchemaError(path, f"expected a string, got {type(value).__name__}")
        max_len = meta.get("max_len")
        if max_len is not None and len(value) > max_len:
            raise SchemaError(path, f"string of {len(value)} characters exceeds {max_len}")
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(str(m.value) for m in tp)
            raise SchemaError(path, f"{value!r} is not one of: {allowed}") from None
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise SchemaError(path, f"expected a list, got {type(value).__name__}")
        (item_tp, *_rest) = typing.get_args(tp)
        items = [convert(v, item_tp, f"{path}[{i}]", meta) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise SchemaError(path, f"expected an object, got {type(value).__name__}")
        _key_tp, val_tp = typing.get_args(tp)  # keys are JSON object keys: always str
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise SchemaError(path, f"object key {k!r} is not a string")
            out[k] = convert(v, val_tp, _join(path, k), meta)
        return out
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return from_mapping(tp, value, path)
    raise SchemaError(path, f"unsupported annotation {tp!r}")


T = typing.TypeVar("T")


def from_mapping(cls: type[T], data: Any, path: str = "", ignore: frozenset[str] = frozenset()) -> T:
    """Build dataclass ``cls`` from a mapping; unknown keys and missing fields are errors."""
    if not isinstance(data, dict):
        raise SchemaError(path, f"expected an object, got {type(data).__name__}")
    hints = _hints(cls)  # type: ignore[arg-type]  # classes are hashable; mypy cannot see it for type[T]
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields) - ignore)
    if unknown:
        raise SchemaError(path, f"unknown field(s) {', '.join(map(repr, unknown))}")
    kwargs = {}
    for name, f in fields.items():
        if not f.init:
            continue
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SchemaError(_join(path, name), "is required")
            continue
        kwargs[name] = convert(data[name], hints[name], _join(path, name), dict(f.metadata))
    try:
        obj = cls(**kwargs)
    except (ValueError, TypeError) as exc:  # __post_init__ cross-field checks
        if isinstance(exc, SchemaError):
            raise SchemaError(_join(path, exc.path) if exc.path else path, exc.reason) from None
        raise SchemaError(path, str(exc)) from None
    return obj


def to_plain(value: Any) -> Any:
    """Dataclass/enum tree -> JSON-ready plain values (inverse of :func:`convert`)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value
