"""Strict conversion of decoded JSON/YAML values into typed dataclasses.

One checker serves both wire events (``trainguard.schemas.codec``) and configuration files
(``trainguard.schemas.config``), so "what a valid value is" is defined once.  Every failure is a
:class:`SchemaError` that names the exact path of the bad value (``gpus[3].temperature_c``),
which is what ends up in a dead-letter record or a config error message.

Supported annotations: ``int``, ``float``, ``str``, ``bool``, ``X | None``, ``list[X]``,
``tuple[X, ...]``, ``dict[str, X]``, ``Any`` (any JSON value), ``enum.Enum`` subclasses and
nested dataclasses.  Limits come from field metadata, ``field(metadata=bounds(...))``, and apply
to every value *inside* the field, at any level of its lists and dicts (a nested dataclass has its
own fields' metadata):

* ``lo``/``hi`` -- inclusive range of every number (``ranks: list[int]``: of each rank);
* ``allow_nan`` -- NaN/Inf accepted in floats (rejected otherwise);
* ``max_len`` -- characters of every string, dict keys included;
* ``max_items`` -- items of every list and dict;
* ``name`` -- a :class:`~trainguard.schemas.names.NameRule` every string (dict keys included) must
  follow: a job or node name (``trainguard.schemas.names``).

Inside an ``Any`` value (free-form JSON) only strings and containers are checked: its numbers are
whatever JSON holds, NaN and Infinity included.

Strings never hold a lone surrogate (``"\\ud800"`` is valid JSON, but such a string cannot be
encoded to UTF-8: not for Kafka, not for ClickHouse), in typed fields and inside ``Any`` values.
Error messages show values shortened and escaped, so a reason is always short, printable text.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import reprlib
import types
import typing
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any, Union

from trainguard.schemas.names import NameRule


class SchemaError(ValueError):
    """A value does not fit its schema; ``path`` locates it, ``reason`` says why."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}" if path else reason)


def bounds(
    lo: float | None = None,
    hi: float | None = None,
    *,
    allow_nan: bool = False,
    max_len: int | None = None,
    max_items: int | None = None,
    name: NameRule | None = None,
) -> dict[str, Any]:
    """Field metadata for range checks: inclusive ``lo``/``hi`` of every number in the field,
    NaN/Inf only if ``allow_nan``, at most ``max_len`` characters per string and ``max_items``
    items per list or dict, every string a valid ``name`` if given."""
    return {
        "lo": lo,
        "hi": hi,
        "allow_nan": allow_nan,
        "max_len": max_len,
        "max_items": max_items,
        "name": name,
    }


#: a lone (unpaired) surrogate code point: representable in a Python str, not in UTF-8.
_SURROGATE = re.compile("[\ud800-\udfff]")

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = 4
_REPR.maxlevel = 2


def show(value: Any) -> str:
    """A short, printable ``repr`` of ``value`` for error messages (never a lone surrogate)."""
    try:
        return _REPR.repr(value)
    except Exception:  # a repr that raises (an int too long for str()) must not hide the error
        return f"<{type(value).__name__}>"


def _check_text(value: str, meta: Mapping[str, Any], path: str, what: str = "string") -> None:
    rule: NameRule | None = meta.get("name")
    if rule is not None:  # its own words: "name of 300 characters exceeds 128", "name '..' starts with"
        why = rule.problem(value)
        if why is not None:
            raise SchemaError(path, why if what == "string" else f"{what}: {why}")
    max_len = meta.get("max_len")
    if max_len is not None and len(value) > max_len:
        raise SchemaError(path, f"{what} of {len(value)} characters exceeds {max_len}")
    bad = _SURROGATE.search(value)
    if bad is not None:
        raise SchemaError(
            path, f"{what} holds a lone surrogate U+{ord(bad[0]):04X} at character {bad.start()}"
        )


def _check_size(
    value: list[Any] | tuple[Any, ...] | dict[Any, Any], meta: Mapping[str, Any], path: str
) -> None:
    max_items = meta.get("max_items")
    if max_items is not None and len(value) > max_items:
        raise SchemaError(path, f"{len(value)} items exceed the maximum {max_items}")


def show_text(text: str, limit: int = 1000) -> str:
    """``text`` cut to ``limit`` characters, lone surrogates escaped (safe in any UTF-8 reason)."""
    cut = text if len(text) <= limit else text[:limit] + "..."
    return cut.encode("utf-8", "backslashreplace").decode("utf-8")


_PLAIN_KEY = re.compile(r"[\w./:@-]{1,60}")


def _key_path(path: str, key: str) -> str:
    """``path.key``; a long or odd key (spaces, quotes, control characters) is shown as ``path['...']``."""
    return _join(path, key) if _PLAIN_KEY.fullmatch(key) else f"{path}[{show(key)}]"


def _item_path(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return _key_path(path, key) if isinstance(key, str) else f"{path}[{show(key)}]"


def _check_json(value: Any, meta: Mapping[str, Any], path: str) -> None:
    """Every string (keys too) and container inside an ``Any`` value, walked without recursion
    (the depth of a decoded document is bounded by the codec, that of a config file by YAML)."""
    max_len = meta.get("max_len")

    def bad(text: str) -> bool:
        return (max_len is not None and len(text) > max_len) or _SURROGATE.search(text) is not None

    if isinstance(value, str):
        _check_text(value, meta, path)
    todo = [(value, path)] if isinstance(value, dict | list | tuple) else []
    while todo:
        container, where = todo.pop()
        _check_size(container, meta, where)
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for k, item in items:
            if isinstance(k, str) and bad(k):
                _check_text(k, meta, where, "object key")
            if isinstance(item, str):
                if bad(item):
                    _check_text(item, meta, _item_path(where, k))
            elif isinstance(item, dict | list | tuple):
                todo.append((item, _item_path(where, k)))


@cache
def _hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@cache
def _shape(tp: Any) -> tuple[Any, tuple[Any, ...]]:
    """``(get_origin(tp), get_args(tp))``, once per annotation: every message asks again for
    the same few dozen annotations, and the ``typing`` calls were a tenth of a worker's CPU."""
    return typing.get_origin(tp), typing.get_args(tp)


@dataclasses.dataclass(frozen=True)
class _Field:
    """One init field of a dataclass, prepared once: its annotation, metadata and, for the
    quick check of a plain value, the leaf type (``X`` of ``X | None``) and its limits."""

    name: str
    tp: Any
    meta: Any  # the field's metadata mapping, read only
    required: bool
    optional: bool
    leaf: Any
    lo: Any
    hi: Any
    allow_nan: bool
    max_len: int | None
    #: the fast check of a name field (a regex's fullmatch), None for other fields.
    name_ok: Callable[[str], Any] | None

    def plain_ok(self, value: Any) -> bool:
        """``value`` is valid as is, by the same rules :func:`convert` applies (False: let
        :func:`convert` decide, and name the error)."""
        kind = type(value)
        if kind is float and (self.leaf is float):
            if value != value or value in (math.inf, -math.inf):
                return False
        elif kind is int and (self.leaf is int or self.leaf is float):
            if self.leaf is float:
                return False  # converted to float by convert
        elif kind is str and self.leaf is str:
            if self.name_ok is not None and self.name_ok(value) is None:
                return False
            return (self.max_len is None or len(value) <= self.max_len) and _SURROGATE.search(value) is None
        else:
            return False
        return (self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi)


@cache
def _fields(cls: Any) -> tuple[tuple[_Field, ...], frozenset[str]]:
    """The init fields of dataclass ``cls`` with their resolved annotations, and every field
    name (an unknown key check), computed once per class."""
    hints = _hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        tp = hints[f.name]
        origin, args = _shape(tp)
        inner = [a for a in args if a is not type(None)]
        optional = origin in (Union, types.UnionType) and type(None) in args and len(inner) == 1
        leaf = inner[0] if optional else tp
        meta = f.metadata
        out.append(
            _Field(
                f.name,
                tp,
                meta,
                required,
                optional,
                leaf,
                meta.get("lo"),
                meta.get("hi"),
                bool(meta.get("allow_nan")),
                meta.get("max_len"),
                meta["name"].pattern.fullmatch if meta.get("name") is not None else None,
            )
        )
    return tuple(out), frozenset(f.name for f in dataclasses.fields(cls))


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _check_number(value: float, meta: Mapping[str, Any], path: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        if not meta.get("allow_nan"):
            raise SchemaError(path, f"non-finite value {value!r} not allowed")
        return
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and value < lo:
        raise SchemaError(path, f"{show(value)} is below the minimum {lo!r}")
    if hi is not None and value > hi:
        raise SchemaError(path, f"{show(value)} is above the maximum {hi!r}")


def _all_valid(items: list[Any] | tuple[Any, ...], item_tp: Any, meta: Mapping[str, Any]) -> bool:
    """Fast path for long lists of ints or strings (every rank of a job): whether every item is
    valid as is.  False sends the caller to the item-by-item check, which names the bad one."""
    if item_tp is int and all(type(v) is int for v in items):
        lo, hi = meta.get("lo"), meta.get("hi")
        return not items or ((lo is None or min(items) >= lo) and (hi is None or max(items) <= hi))
    if item_tp is str and all(type(v) is str for v in items):
        max_len = meta.get("max_len")
        if max_len is not None and items and max(map(len, items)) > max_len:
            return False
        rule: NameRule | None = meta.get("name")
        if rule is not None and not all(map(rule.pattern.fullmatch, items)):
            return False
        return _SURROGATE.search("".join(items)) is None
    return False


def convert(value: Any, tp: Any, path: str = "", meta: Mapping[str, Any] | None = None) -> Any:
    """Return ``value`` converted to annotation ``tp`` or raise :class:`SchemaError`."""
    meta = meta or _NO_META
    # The common leaves first, before any annotation analysis: most fields are plain numbers
    # and strings, and the checks below are the same ones the general path makes.
    if tp is float and type(value) is float:
        _check_number(value, meta, path)
        return value
    if tp is int and type(value) is int:
        _check_number(value, meta, path)
        return value
    if tp is str and type(value) is str:
        _check_text(value, meta, path)
        return value
    origin, args = _shape(tp)
    if tp is Any:
        _check_json(value, meta, path)
        return value
    if origin in (Union, types.UnionType):
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
                raise SchemaError(path, f"expected an integer, got {type(value).__name__} {show(value)}")
        _check_number(value, meta, path)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SchemaError(path, f"expected a number, got {type(value).__name__} {show(value)}")
        try:
            value = float(value)
        except OverflowError:  # an int beyond the float range (JSON allows 4300 digits)
            raise SchemaError(path, f"{show(value)} is out of the float range") from None
        _check_number(value, meta, path)
        return value
    if tp is str:
        if not isinstance(value, str):
            raise SchemaError(path, f"expected a string, got {type(value).__name__}")
        _check_text(value, meta, path)
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except (ValueError, TypeError):
            allowed = ", ".join(str(m.value) for m in tp)
            raise SchemaError(path, f"{show(value)} is not one of: {allowed}") from None
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise SchemaError(path, f"expected a list, got {type(value).__name__}")
        _check_size(value, meta, path)
        (item_tp, *_rest) = args
        if _all_valid(value, item_tp, meta):
            return tuple(value) if origin is tuple else list(value)
        items = [convert(v, item_tp, f"{path}[{i}]", meta) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise SchemaError(path, f"expected an object, got {type(value).__name__}")
        _check_size(value, meta, path)
        _key_tp, val_tp = args  # keys are JSON object keys: always str
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise SchemaError(path, f"object key {show(k)} is not a string")
            _check_text(k, meta, path, "object key")
            out[k] = convert(v, val_tp, _key_path(path, k), meta)
        return out
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return from_mapping(tp, value, path)
    raise SchemaError(path, f"unsupported annotation {tp!r}")


T = typing.TypeVar("T")
#: the metadata of a field without any (read only, shared).
_NO_META: Mapping[str, Any] = types.MappingProxyType({})


def from_mapping(cls: type[T], data: Any, path: str = "", ignore: frozenset[str] = frozenset()) -> T:
    """Build dataclass ``cls`` from a mapping; unknown keys and missing fields are errors."""
    if type(data) is dict and not ignore:
        obj = _fast(cls)(data)  # type: ignore[arg-type]  # classes are hashable; mypy cannot see it for type[T]
        if obj is not _MISS:
            return obj
    if not isinstance(data, dict):
        raise SchemaError(path, f"expected an object, got {type(data).__name__}")
    fields, names = _fields(cls)  # type: ignore[arg-type]  # as above
    if not names.issuperset(data):
        extra = set(data) - names - ignore
        unknown = sorted(k if isinstance(k, str) else repr(k) for k in extra)
        if unknown:
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise SchemaError(path, f"unknown field(s) {', '.join(map(show, unknown[:5]))}{more}")
    kwargs = {}
    for f in fields:
        if f.name not in data:
            if f.required:
                raise SchemaError(_join(path, f.name), "is required")
            continue
        value = data[f.name]
        if (value is None and f.optional) or f.plain_ok(value):
            kwargs[f.name] = value  # the common case, checked without building a path
            continue
        kwargs[f.name] = convert(value, f.tp, _join(path, f.name), f.meta)
    try:
        obj = cls(**kwargs)
    except (ValueError, TypeError) as exc:  # __post_init__ cross-field checks
        if isinstance(exc, SchemaError):
            raise SchemaError(_join(path, exc.path) if exc.path else path, exc.reason) from None
        raise SchemaError(path, show_text(str(exc))) from None
    return obj


#: what a fast checker returns for a mapping it cannot vouch for (the general path then decides).
_MISS: Any = object()


@cache
def _fast(cls: Any) -> Callable[[dict[str, Any]], Any]:
    """A checker compiled for dataclass ``cls``: the instance :func:`from_mapping` would build
    from a mapping, or ``_MISS`` when any value is not valid *as it is* (a missing field, an int
    in a float field, NaN, a bad value: the general path then converts it or names the error).

    Generated source, one line per check, like ``dataclasses`` builds ``__init__``: the general
    path asks a ``_Field`` per value; decoding ran at ~20 us per GPU and was the largest cost of a
    stream worker.  It accepts only what the general path accepts, and builds the same object
    (``tests/schemas/test_typecheck_fast.py`` holds the two side by side)."""
    fields, names = _fields(cls)
    specs = {x.name: x for x in dataclasses.fields(cls)}
    env: dict[str, Any] = {"_MISS": _MISS, "_cls": cls, "_names": names, "_conv": _conv}
    lines = ["def fast(data):", "    if not _names.issuperset(data):", "        return _MISS"]
    for i, f in enumerate(fields):
        v = f"v{i}"
        lines.append(f"    {v} = data.get({f.name!r}, _MISS)")
        lines.append(f"    if {v} is _MISS:")
        if f.required:
            lines.append("        return _MISS")
        else:  # what the class's __init__ would set: its default, or a fresh one from the factory
            spec = specs[f.name]
            if spec.default is not dataclasses.MISSING:
                env[f"_default{i}"] = spec.default
                lines.append(f"        {v} = _default{i}")
            else:
                env[f"_factory{i}"] = spec.default_factory
                lines.append(f"        {v} = _factory{i}()")
        lines.append("    else:")
        cond, value = _fast_field(f.tp, f.meta, v, f"f{i}", env)
        lines.append(f"        if not ({cond}):")
        lines.append("            return _MISS")
        if value != v:
            lines.append(f"        {v} = {value}")
            lines.append(f"        if {v} is _MISS:")
            lines.append("            return _MISS")
    kwargs = ", ".join(f"{f.name!r}: v{i}" for i, f in enumerate(fields))
    if len(specs) == len(fields) and not hasattr(cls, "__post_init__") and "__slots__" not in vars(cls):
        # What the generated __init__ does (a frozen one through object.__setattr__ per field,
        # half the cost of a GPU sample), done at once, in field order.
        env["_new"] = object.__new__
        lines += ["    obj = _new(_cls)", f"    obj.__dict__.update({{{kwargs}}})", "    return obj"]
    else:  # __post_init__ checks, init=False fields: the class's own constructor
        lines += ["    try:", f"        return _cls(**{{{kwargs}}})"]
        lines += ["    except Exception:", "        return _MISS"]
    exec("\n".join(lines), env)  # our own source, built from the class annotations
    fast: Callable[[dict[str, Any]], Any] = env["fast"]
    return fast


def _conv(value: Any, tp: Any, meta: Mapping[str, Any]) -> Any:
    """:func:`convert` for the kinds the fast checker does not inline; ``_MISS`` on an error."""
    try:
        return convert(value, tp, "", meta)
    except SchemaError:
        return _MISS


def _fast_field(tp: Any, meta: Mapping[str, Any], v: str, tag: str, env: dict[str, Any]) -> tuple[str, str]:
    """``(condition, value)`` source for one field of the fast checker: the condition holds when
    ``v`` is valid as is for ``tp``; the value expression is what :func:`convert` returns for it
    (``_MISS`` when it cannot tell)."""
    origin, args = _shape(tp)
    lo, hi = meta.get("lo"), meta.get("hi")

    def within(x: str) -> list[str]:
        low = [f"{x} >= {lo!r}"] if lo is not None else []
        return low + ([f"{x} <= {hi!r}"] if hi is not None else [])

    if tp is float:
        # NaN fails every comparison; an infinity passes one bound only: without both bounds,
        # v - v == 0.0 is the finiteness check (non-finite values take the general path).  An
        # int (a producer's 8 for 8.0) is converted as the general path does, its range checked
        # on the float; one beyond +-1e300 takes the general path (float() could overflow).
        finite = [] if lo is not None and hi is not None else [f"{v} - {v} == 0.0"]
        as_float = " and ".join([f"type({v}) is float", *finite, *within(v)])
        as_int = " and ".join([f"type({v}) is int", f"-1e300 < {v} < 1e300", *within(f"float({v})")])
        return f"({as_float}) or ({as_int})", f"({v} if type({v}) is float else float({v}))"
    if tp is int:
        return " and ".join([f"type({v}) is int", *within(v)]), v
    if tp is bool:
        return f"type({v}) is bool", v
    if tp is str:
        max_len = meta.get("max_len")
        size = [f"len({v}) <= {max_len!r}"] if max_len is not None else []
        env["_surr"] = _SURROGATE.search
        rule = meta.get("name")
        named = []
        if rule is not None:  # a name is ASCII: its check makes the surrogate one moot
            env[f"_name_{tag}"] = rule.pattern.fullmatch
            named = [f"_name_{tag}({v}) is not None"]
        return " and ".join([f"type({v}) is str", *size, *named, f"({v}.isascii() or _surr({v}) is None)"]), v
    if origin in (Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            cond, value = _fast_field(inner[0], meta, v, tag, env)
            return f"{v} is None or ({cond})", v if value == v else f"None if {v} is None else {value}"
    if isinstance(tp, type) and issubclass(tp, enum.Enum) and all(type(m.value) is str for m in tp):
        env[f"_e_{tag}"] = {m.value: m for m in tp}
        return f"type({v}) is str and {v} in _e_{tag}", f"_e_{tag}[{v}]"
    if origin in (list, tuple) and args and args[0] in (int, str):  # convert checks args[0] only
        env["_all_valid"], env[f"_meta_{tag}"] = _all_valid, meta
        max_items = meta.get("max_items")
        size = [f"len({v}) <= {max_items!r}"] if max_items is not None else []
        check = f"_all_valid({v}, {args[0].__name__}, _meta_{tag})"
        return " and ".join([f"type({v}) is list", *size, check]), f"{origin.__name__}({v})"
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        env[f"_d_{tag}"] = _fast(args[0])  # type: ignore[arg-type]  # a class, hashable
        env["_fast_list"] = _fast_list
        max_items = meta.get("max_items")
        size = [f"len({v}) <= {max_items!r}"] if max_items is not None else []
        return " and ".join([f"type({v}) is list", *size]), f"_fast_list(_d_{tag}, {v})"
    env[f"_tp_{tag}"], env[f"_meta_{tag}"] = tp, meta
    return "True", f"_conv({v}, _tp_{tag}, _meta_{tag})"


def _fast_list(check: Callable[[dict[str, Any]], Any], items: list[Any]) -> Any:
    out = [check(x) if type(x) is dict else _MISS for x in items]
    for x in out:
        if x is _MISS:
            return _MISS
    return out


_PLAIN = frozenset({int, float, str, bool, type(None)})


def to_plain(value: Any) -> Any:
    """Dataclass/enum tree -> JSON-ready plain values (inverse of :func:`convert`)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list | tuple):
        if all(type(v) in _PLAIN for v in value):  # fast path: a long list of numbers or names
            return list(value)
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value
