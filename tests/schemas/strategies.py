"""Hypothesis strategies that build valid instances of any schema dataclass, and hostile documents.

Derived from the same type hints and ``bounds`` metadata the codec validates against, so a new
event type gets round-trip coverage without new test code.  Valid values span each field's FULL
declared range: integers from ``lo`` to ``hi`` (the extremes included), any finite float in range
(NaN/Inf where ``allow_nan``), strings of any non-surrogate characters up to ``max_len`` (job and
node names: any valid name, ``trainguard.schemas.names``), lists
and dicts of scalars up to ``max_items`` (as long as the record stays a few MB).

:func:`hostile_document` starts from a valid event and replaces one value anywhere in it with
something a producer bug or an attacker could send: out-of-range and 4301-digit integers, NaN and
Infinity literals, lone surrogates, huge strings and lists, deep nesting, wrong types.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from typing import Any, Union

from hypothesis import strategies as st

from trainguard.schemas.codec import MAX_DEPTH, to_dict
from trainguard.schemas.typecheck import to_plain

#: any character that UTF-8 can encode (no lone surrogates: they are hostile input, not valid).
CHARS = st.characters(codec="utf-8")
#: about how many bytes of JSON one repeated list may take (the exact limits are tested one by one).
LIST_BUDGET = 20_000

_JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),  # NaN/Inf included: Any values carry them (the wire's NaN/Infinity extensions)
    st.text(CHARS, max_size=10),
)
_JSON = st.recursive(
    _JSON_LEAF,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(CHARS, max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


def _text(meta: dict[str, Any]) -> st.SearchStrategy[str]:
    max_len = meta.get("max_len")
    cap = max_len if max_len is not None else 1000
    rule = meta.get("name")
    if rule is not None:  # a job or node name: any valid one, the longest included
        names = st.from_regex(rule.pattern, fullmatch=True)
        return names | st.builds(
            lambda c, n: c * n, st.sampled_from("aZ9_"), st.integers(1, cap) | st.just(cap)
        )
    # Short random text, or one character repeated up to the limit (cheap even for 1 Mi characters).
    return st.text(CHARS, max_size=min(cap, 20)) | st.builds(
        lambda c, n: c * n, CHARS, st.integers(0, cap) | st.just(cap)
    )


def _number(tp: type, meta: dict[str, Any]) -> st.SearchStrategy[Any]:
    lo, hi = meta.get("lo"), meta.get("hi")
    if tp is int:
        lo_i = int(lo) if lo is not None else None
        hi_i = int(hi) if hi is not None else None
        ends = [v for v in (lo_i, hi_i) if v is not None]
        full = st.integers(lo_i, hi_i)
        return full | st.sampled_from(ends) if ends else full
    base = st.floats(lo, hi, allow_nan=False, allow_infinity=False)
    if meta.get("allow_nan"):
        base = base | st.sampled_from([float("nan"), float("inf"), float("-inf")])
    return base


def _weight(value: Any) -> int:
    """Rough JSON size of one repeated item."""
    return len(json.dumps(to_plain(value), ensure_ascii=False)) + 1


def _repeat(item: Any, n: int) -> list[Any]:
    return [item] * min(n, max(1, LIST_BUDGET // _weight(item)))


def _is_scalar(tp: Any) -> bool:
    return tp in (int, float, str, bool) or (isinstance(tp, type) and issubclass(tp, enum.Enum))


def strategy_for(tp: Any, meta: dict[str, Any] | None = None) -> st.SearchStrategy[Any]:
    meta = meta or {}
    origin = typing.get_origin(tp)
    max_items = meta.get("max_items")
    few = min(max_items, 3) if max_items is not None else 3
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
        return _text(meta)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if origin is list:
        item_tp = typing.get_args(tp)[0]
        item = strategy_for(item_tp, meta)
        small = st.lists(item, max_size=few)
        if max_items is None or not _is_scalar(item_tp):
            return small
        # The full declared length: one value repeated (up to LIST_BUDGET bytes of JSON).
        return small | st.builds(_repeat, item, st.integers(0, max_items) | st.just(max_items))
    if origin is dict:
        val_tp = typing.get_args(tp)[1]
        keys, values = _text(meta), strategy_for(val_tp, meta)
        small = st.dictionaries(keys, values, max_size=few)
        if max_items is None or not _is_scalar(val_tp):
            return small
        return small | st.builds(
            lambda v, n: {f"k{i}": v for i in range(n)},
            values,
            st.integers(0, max_items) | st.just(max_items),
        )
    if dataclasses.is_dataclass(tp):
        return dataclass_strategy(tp)
    raise TypeError(f"no strategy for {tp!r}")


def dataclass_strategy(cls: type) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls)
    fields = {
        f.name: strategy_for(hints[f.name], dict(f.metadata)) for f in dataclasses.fields(cls) if f.init
    }
    return st.builds(cls, **fields)


# -- hostile documents -----------------------------------------------------------------------------

#: placeholders swapped for raw JSON text after ``json.dumps`` (which cannot write these itself).
_RAW = {
    "\x00big-int\x00": "9" * 4301,  # one digit over Python's int_max_str_digits
    "\x00neg-big-int\x00": "-" + "1" * 5000,
    "\x00deep\x00": "[" * 5000 + "0" + "]" * 5000,  # deeper than the interpreter's recursion limit
    "\x00deep-obj\x00": '{"a":' * 2000 + "0" + "}" * 2000,
}


def _nested(depth: int, leaf: Any = 0) -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"x": value}
    return value


#: hostile containers, built fresh for each draw (a document is mutated in place).
_CONTAINERS: list[typing.Callable[[], Any]] = [
    list,
    dict,
    lambda: [0] * (2**20 + 1),  # one more than any list of ranks may hold
    lambda: list(range(-5, 5)),
    lambda: [2**40] * 3,
    lambda: {"\ud800": 1},
    lambda: {"k" * 300: 1},
    lambda: {"a": "\udc00"},
    lambda: _nested(MAX_DEPTH - 5),
    lambda: _nested(MAX_DEPTH + 1),
    lambda: [None],
    lambda: [[1, 2], [3]],
    lambda: {"index": 0},
]

HOSTILE_VALUES: st.SearchStrategy[Any] = st.one_of(
    # integers at and beyond every storage width, and JSON's own digit limit
    st.sampled_from(
        [
            -1,
            2**31,
            -(2**31) - 1,
            2**32,
            2**53 + 1,
            2**63,
            -(2**63) - 1,
            2**64,
            -(2**64),
            10**300,
            10**4299,
            4_102_444_800_001,  # just past 2100-01-01 in ms
            1_700_000_000_000_000,  # microseconds: a unit mistake
            *_RAW,
        ]
    ),
    st.integers(),
    # floats: NaN/Infinity literals, huge, integral floats, negative zero
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 1e20, -0.0, 0.5]),
    # strings: lone surrogates (escaped by json.dumps), control characters, huge
    st.sampled_from(["\ud800", "a\udfffb", "\udbff\udbff", "\x00", "x" * 70_000, "\u2028", "é" * 300]),
    # names that are paths, options or no name at all (refused in job and node fields only)
    st.sampled_from(["..", "../etc/passwd", "a/b", "-rf", ".hidden", "a b", "n" * 300, ""]),
    st.text(CHARS | st.characters(categories=["Cs"]), min_size=1, max_size=8),  # lone surrogates
    st.sampled_from(_CONTAINERS).map(lambda make: make()),
    st.none(),
    st.booleans(),
    _JSON,
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in ``doc`` a value can be put: each key and index (the first 5 of a list)."""
    out: list[tuple[Any, ...]] = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc[:5]) if isinstance(doc, list) else ()
    for k, v in items:
        if prefix or k not in ("schema", "version"):
            out.append((*prefix, k))
        out += _paths(v, (*prefix, k))
    return out


def _put(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for step in path[:-1]:
        doc = doc[step]
    doc[path[-1]] = value


def _dump(doc: Any) -> bytes:
    """Compact JSON; surrogates escaped (ensure_ascii), placeholders replaced by raw literals."""
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=True)
    for placeholder, raw in _RAW.items():
        text = text.replace(json.dumps(placeholder), raw)
    return text.encode()


@st.composite
def hostile_document(draw: st.DrawFn, cls: type) -> bytes:
    """A valid ``cls`` event's JSON with one or two values (envelope included) replaced by hostile ones."""
    try:
        doc = to_dict(draw(dataclass_strategy(cls)))
    except ValueError:  # a drawn combination broke a cross-field rule: start from a minimal doc
        doc = {"schema": cls.TYPE, "version": cls.VERSION}
    for _ in range(draw(st.integers(1, 2))):
        # Fields first (hypothesis leans to the front of a list), then the envelope, a new field.
        path = draw(st.sampled_from([*_paths(doc), ("version",), ("schema",), ("zz_new_field",)]))
        _put(doc, path, draw(HOSTILE_VALUES))
    return _dump(doc)
