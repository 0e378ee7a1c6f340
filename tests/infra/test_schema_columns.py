"""One source of truth per schema: the rows derived from the event dataclasses
(``infra/clickhouse/rows.py``) have exactly the columns the migrations create, with compatible types.

A new event field, or a migration that changes a table, fails here until the other side follows
(a new field needs a column -- a new migration -- or a declared ``skip``/override in its spec).
The columns are read from ``system.columns`` after applying the migrations, on chDB and on the
ClickHouse 18.16 server (that variant is marked slow).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import types
import typing
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Union

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.infra.events import XID_79, one_of_each
from tests.schemas.strategies import dataclass_strategy, hostile_document
from trainguard.infra.clickhouse.rows import (
    MAPS,
    TABLES,
    Arrays,
    Column,
    Json,
    TableMap,
    TableSpec,
    line_hash,
)
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.config import load_settings
from trainguard.schemas.base import EVENT_TYPES, Event
from trainguard.schemas.codec import DecodeError, decode
from trainguard.schemas.control import JobSpec
from trainguard.schemas.limits import MAX_TS_MS
from trainguard.schemas.telemetry import HostSample

#: Integer columns whose field declares no range (``bounds``) that fits the column type, and why
#: they are accepted for now.  A codec-valid event with a value outside the column type fails its
#: insert (clickhouse-connect cannot pack it), so every new entry here is a schema gap to close.
UNBOUNDED: dict[tuple[str, str], str] = {}

#: ``DateTime('UTC')`` holds seconds 0 .. 2**32 - 1 (18.16 has no DateTime64).
DATETIME_MAX_MS = (2**32 - 1) * 1000

_INT = {
    f"{u}Int{n}": (0 if u else -(2 ** (n - 1)), 2**n - 1 if u else 2 ** (n - 1) - 1)
    for u in ("", "U")
    for n in (8, 16, 32, 64)
}
_NULLABLE = re.compile(r"Nullable\((.*)\)")
_ARRAY = re.compile(r"Array\((.*)\)")


def _optional(tp: Any) -> Any | None:
    if typing.get_origin(tp) in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner[0] if len(inner) == 1 else None
    return None


def type_mismatch(tp: Any, meta: typing.Mapping[str, Any], ch: str) -> str | None:
    """Why a value described by Python type ``tp`` (and its ``bounds``) does not fit column type
    ``ch``; None when it does."""
    inner, nullable = _optional(tp), _NULLABLE.fullmatch(ch)
    if inner is not None:
        return (
            type_mismatch(inner, meta, nullable[1]) if nullable else f"may be None but {ch} is not Nullable"
        )
    if nullable:
        return f"is never None but the column is {ch}"
    if typing.get_origin(tp) in (list, tuple):
        array = _ARRAY.fullmatch(ch)
        return (
            type_mismatch(typing.get_args(tp)[0], meta, array[1])
            if array
            else f"is a list, {ch} is not an Array"
        )
    if tp is str or (isinstance(tp, type) and issubclass(tp, enum.Enum)):
        return None if ch == "String" else f"is a string, {ch} is not String"
    if tp is bool:
        return None if ch == "UInt8" else f"is a bool (0/1), {ch} is not UInt8"
    if tp is float:
        return None if ch in ("Float32", "Float64") else f"is a float, {ch} is not Float32/Float64"
    if tp is datetime:
        return None if ch.startswith("DateTime") else f"is a datetime, {ch} is not DateTime"
    if tp is int:
        if ch not in _INT:
            return f"is an int, {ch} is not an integer type"
        lo, hi = meta.get("lo"), meta.get("hi")
        if lo is None or hi is None:
            return f"declares no range that fits {ch}"
        if lo < _INT[ch][0] or hi > _INT[ch][1]:
            return f"allows {lo}..{hi}, beyond {ch}"
        return None
    return f"unsupported type {tp!r}"


def value_fits(v: Any, ch: str, check_range: bool = True) -> bool:
    """Whether a row value can be inserted into a column of type ``ch``."""
    if nullable := _NULLABLE.fullmatch(ch):
        return v is None or value_fits(v, nullable[1], check_range)
    if array := _ARRAY.fullmatch(ch):
        return isinstance(v, list) and all(value_fits(x, array[1], check_range) for x in v)
    if ch == "String":
        return isinstance(v, str)
    if ch in ("Float32", "Float64"):
        return isinstance(v, float | int) and not isinstance(v, bool)
    if ch.startswith("DateTime"):
        return isinstance(v, datetime) and v.tzinfo is not None and 0 <= v.timestamp() < 2**32
    if ch in _INT:
        lo, hi = _INT[ch]
        return type(v) is int and (not check_range or lo <= v <= hi)
    raise AssertionError(f"no rule for column type {ch}")


def _field_meta(cls: Any, path: str) -> typing.Mapping[str, Any] | None:
    """The ``bounds`` metadata of the field at dotted ``path`` (lists walked into), None if no field."""
    meta: typing.Mapping[str, Any] | None = None
    for part in path.split("."):
        while typing.get_origin(cls) in (list, tuple):
            cls = typing.get_args(cls)[0]
        if not dataclasses.is_dataclass(cls):
            return None
        f = next((f for f in dataclasses.fields(cls) if f.name == part), None)
        if f is None:
            return None
        cls, meta = typing.get_type_hints(cls)[part], f.metadata
    return meta


def column_meta(m: TableMap, col: Column) -> typing.Mapping[str, Any]:
    """A column's bounds: its own, or, where the mapper declares none (the values array of a
    ``KeyValueArrays``), those of the field it stores."""
    return col.meta or _field_meta(m.event, col.source) or {}


def _problems(m: TableMap, ddl: dict[str, str]) -> list[str]:
    derived: dict[str, Column] = {c.name: c for c in m.columns}
    out = [f"{m.table}.{n} ({ddl[n]}): no field maps to it" for n in sorted(ddl.keys() - derived.keys())]
    out += [
        f"{m.table}: {derived[n].source} -> column {n!r}, which the migrations do not create"
        for n in sorted(derived.keys() - ddl.keys())
    ]
    for name in sorted(ddl.keys() & derived.keys()):
        col = derived[name]
        why = type_mismatch(col.type, column_meta(m, col), ddl[name])
        if why and (m.table, name) not in UNBOUNDED:
            out.append(f"{m.table}.{name} ({ddl[name]}): {col.source} {why}")
    return out


def _ddl_columns(store: ClickHouseStore) -> dict[str, dict[str, str]]:
    return {m.table: dict(zip(*store.columns(m.table), strict=True)) for m in MAPS.values()}


def test_every_event_type_is_stored() -> None:
    assert set(MAPS) == set(EVENT_TYPES.values())
    assert len({m.table for m in MAPS.values()}) == len(MAPS)


def test_derived_columns_match_the_migrations(store: ClickHouseStore) -> None:
    ddl = _ddl_columns(store)
    problems = [p for m in MAPS.values() for p in _problems(m, ddl[m.table])]
    assert not problems, "\n".join(problems)
    # The accepted gaps are still gaps (drop an entry once its field declares a range).
    for table, column in UNBOUNDED:
        m = MAPS_BY_TABLE[table]
        col = next(c for c in m.columns if c.name == column)
        assert type_mismatch(col.type, column_meta(m, col), ddl[table][column]), (table, column)


MAPS_BY_TABLE = {m.table: m for m in MAPS.values()}


def test_a_forgotten_side_is_reported() -> None:
    m = MAPS_BY_TABLE["training_steps"]
    ddl = {c.name: "String" for c in m.columns if c.name != "mfu"} | {"extra_col": "UInt8"}
    ddl["rank"] = "UInt16"
    assert _problems(m, ddl) == [
        "training_steps.extra_col (UInt8): no field maps to it",
        "training_steps: mfu -> column 'mfu', which the migrations do not create",
        "training_steps.data_wait_s (String): data_wait_s may be None but String is not Nullable",
        "training_steps.dropped (String): dropped is an int, String is not an integer type",
        "training_steps.grad_norm (String): grad_norm may be None but String is not Nullable",
        "training_steps.loss (String): loss may be None but String is not Nullable",
        "training_steps.rank (UInt16): rank allows 0..10000000, beyond UInt16",
        "training_steps.step (String): step is an int, String is not an integer type",
        "training_steps.step_time_s (String): step_time_s may be None but String is not Nullable",
        "training_steps.tokens (String): tokens may be None but String is not Nullable",
        "training_steps.tokens_per_s (String): tokens_per_s may be None but String is not Nullable",
        "training_steps.ts (String): ts_ms (as DateTime) is a datetime, String is not DateTime",
        "training_steps.ts_ms (String): ts_ms is an int, String is not an integer type",
    ]


def test_an_undeclared_field_or_a_typo_fails_at_build() -> None:
    with pytest.raises(TypeError, match=r"field 'disks' .* declare how it is stored"):
        TableMap(TableSpec("host_samples", HostSample))
    with pytest.raises(TypeError, match=r"no field\(s\) \['disk'\]"):
        TableMap(TableSpec("host_samples", HostSample, skip=("disk",)))
    with pytest.raises(TypeError, match=r"no field disks\.free"):
        TableMap(TableSpec("host_samples", HostSample, overrides=(Arrays("disks", {"free": "free"}),)))
    with pytest.raises(TypeError, match="two columns named 'job'"):
        TableMap(TableSpec("job_specs", JobSpec, skip=("overrides",), overrides=(Json("spec_json"),)))


# -- the rows themselves ---------------------------------------------------------------------------


def _rows(event: Event) -> list[dict[str, Any]]:
    return TABLES[type(event)][1](event)


def test_declared_overrides_give_the_expected_rows() -> None:
    t = 1_700_000_000_123
    gpu, host, nic, hb, step, log, _exit, live, stack, fr, _det, dec, act, _cmd, _dead, spec, check = (
        one_of_each("j", t)
    )
    when = datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC)

    g = _rows(gpu)
    assert [(r["gpu"], r["state"], r["remap_pending"], r["node"], r["ts"]) for r in g] == [
        (0, "ok", 0, "j-node0", when),
        (1, "lost", None, "j-node0", when),
    ]
    assert g[0]["throttle_reasons"] == ["sw_power_cap"] and g[1]["error"] == "NVML_ERROR_GPU_IS_LOST"
    assert "index" not in g[0] and "gpus" not in g[0]

    (h,) = _rows(host)
    assert (h["disk_mounts"], h["disk_total_bytes"], h["disk_used_bytes"]) == (["/"], [10**12], [4 * 10**11])

    n = _rows(nic)
    assert [(r["nic"], r["carrier"], r["counter_names"], r["counter_values"]) for r in n] == [
        ("eth0", 1, [], []),
        ("mlx5_0/1", None, ["link_downed", "symbol_error"], [1, 4]),
    ]

    (b,) = _rows(hb)
    assert (b["source_names"], b["source_ok"], b["source_errors"]) == (["nvml", "nic"], [1, 0], [0, 3])
    assert json.loads(b["sources_json"])[1] == {
        "name": "nic",
        "ok": False,
        "last_success_ms": 0,
        "error_count": 3,
        "duration_ms": 1.5,
        "last_error": "EIO",
    }

    assert _rows(step) == [
        {
            "job": "j",
            "rank": 3,
            "step": 100,
            "ts_ms": t,
            "ts": when,
            "node": "j-node0",
            "loss": 2.31,
            "grad_norm": 0.9,
            "step_time_s": 1.2,
            "tokens": 4096,
            "tokens_per_s": 3400.0,
            "mfu": 0.41,
            "dropped": 0,
            "data_wait_s": None,
        }
    ]
    assert _rows(log)[0]["line_hash"] == line_hash(XID_79) == 0x391927E24B3341B4  # SHA-1's first 8 bytes

    (s,) = _rows(stack)
    assert s["top_frames"] == [
        "all_reduce (torch/distributed/distributed_c10d.py:2501)",
        "train_step (train.py:88)",
    ]
    assert s["role"] == "main" and json.loads(s["process_tree_json"])[1]["role"] == "dataloader"
    assert json.loads(s["threads_json"])[0]["frames"][1]["function"] == "train_step"

    (lv,) = _rows(live)
    assert (lv["ranks"], lv["states"], lv["interval_s"]) == ([2, 3], ["R", "D"], 2.0)

    (f,) = _rows(fr)
    assert (f["rank"], f["capture_id"], f["trigger"], f["entry_count"]) == (3, "cap-1", "capture", 1)
    assert json.loads(f["entries_json"])[0]["op"] == "gloo:all_reduce"
    assert json.loads(f["groups_json"])[0]["ranks"] == [0, 1, 2, 3]

    (d,) = _rows(dec)
    assert (d["machines"], d["ranks"], d["group_kind"], d["action"]) == (
        ["j-node0"],
        [0, 1, 2, 3],
        "machine",
        "evict",
    )
    (a,) = _rows(act)
    assert "group_kind" not in a and (a["phase"], a["machines"], a["ranks"]) == ("succeeded", [], [])

    (j,) = _rows(spec)
    assert (j["tp"], j["pp"], j["dp"], j["ranks_per_machine"], j["rank_order"]) == (2, 2, 1, 4, "tp-dp-pp")
    assert (j["machines"], j["standbys"]) == (["j-node0"], ["j-standby0"])
    assert json.loads(j["spec_json"])["topology"]["job"] == "j" and "overrides" not in j

    (c,) = _rows(check)
    assert (c["node"], c["outcome"], c["action"], c["failed_tests"], c["ts"]) == (
        "j-node0",
        "failed",
        "drained",
        ["gemm-digest"],
        when,
    )
    assert json.loads(c["results"])["gemm-digest"]["passed"] is False


# -- property: every valid event maps to rows of exactly its table's columns ------------------------


@pytest.fixture(scope="module")
def chdb_columns(chdb_dir: Path) -> dict[str, dict[str, str]]:
    """Column name -> type of every table, from the migrations applied to a fresh chDB database."""
    db = f"tgcols_{uuid.uuid4().hex[:10]}"
    store = ClickHouseStore(
        replace(load_settings(environ={}).clickhouse, dsn=f"chdb://{chdb_dir}", database=db)
    )
    try:
        store.migrate()
        return _ddl_columns(store)
    finally:
        store.command(f"DROP DATABASE IF EXISTS {db}")
        store.close()


def _assert_rows_fit(event: Event, columns: dict[str, dict[str, str]]) -> None:
    table, flatten = TABLES[type(event)]
    for row in flatten(event):
        assert row.keys() == columns[table].keys()
        bad = {
            n: (v, columns[table][n])
            for n, v in row.items()
            if not value_fits(v, columns[table][n], check_range=(table, n) not in UNBOUNDED)
        }
        assert not bad


def test_every_instant_fits_datetime() -> None:
    assert MAX_TS_MS <= DATETIME_MAX_MS
    assert datetime.fromtimestamp(MAX_TS_MS / 1000, tz=UTC).year == 2100


@pytest.mark.parametrize("cls", sorted(MAPS, key=lambda c: c.TYPE), ids=lambda c: c.TYPE)
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_every_event_maps_to_rows_of_its_tables_columns(
    cls: type[Event], chdb_columns: dict[str, dict[str, str]], data: st.DataObject
) -> None:
    try:
        event = data.draw(dataclass_strategy(cls))  # every field anywhere in its declared range
    except ValueError:  # a drawn combination broke a cross-field rule: not a valid event
        return
    _assert_rows_fit(event, chdb_columns)


@pytest.mark.parametrize("cls", sorted(MAPS, key=lambda c: c.TYPE), ids=lambda c: c.TYPE)
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_every_document_that_decodes_maps_to_rows_that_fit(
    cls: type[Event], chdb_columns: dict[str, dict[str, str]], data: st.DataObject
) -> None:
    """Whatever arrives on a topic: if the codec accepts it, the sink can insert it."""
    try:
        event = decode(data.draw(hostile_document(cls)))
    except DecodeError:
        return
    _assert_rows_fit(event, chdb_columns)
