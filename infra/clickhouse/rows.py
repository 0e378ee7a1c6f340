"""Events -> ClickHouse rows, derived from the event dataclasses: which table each event type lands
in and how it is flattened.

A table's columns are its event's fields, walked in declaration order:

* a scalar field is a column of the same name; enums store their ``.value``, booleans 0/1;
* a list of scalars is an ``Array`` column, a ``dict[str, Any]`` a JSON string column;
* a nested dataclass (``Decision.targets``) is flattened: its fields are columns of the row;
* ``ts_ms`` is stored as is and also as ``ts``, the ``DateTime('UTC')`` tables are partitioned by.

Where a column differs from a field, the table's :class:`TableSpec` says so explicitly: a renamed
column, a field with no column of its own (``skip``), a field stored whole as JSON (:class:`Json`),
a list of records stored as parallel arrays (:class:`Arrays`), a dict stored as sorted key/value
arrays (:class:`KeyValueArrays`), a computed column (:class:`Computed`), or one row per item of a
list field (``rows_per``: a GPU batch becomes per-GPU rows).  Field paths are dotted from the
event (``targets.group_kind``, ``nics.counters``).  A field that has no default mapping and no
declaration is an error at import time; ``tests/infra/test_schema_columns.py`` checks every table's
derived columns against the columns the migrations create.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import operator
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Union

from trainguard.schemas.base import Event
from trainguard.schemas.control import ActionEvent, Command, DeadLetter, Decision, Detection, JobSpec
from trainguard.schemas.telemetry import GpuSampleBatch, Heartbeat, HostSample, NicSampleBatch, NodeCheck
from trainguard.schemas.typecheck import bounds, to_plain
from trainguard.schemas.workload import (
    FlightRecorderDump,
    LogLine,
    ProcessExit,
    RankLiveness,
    StackDump,
    TrainingStep,
)

Row = dict[str, Any]


def ts(ts_ms: int) -> datetime:
    return datetime.fromtimestamp(ts_ms / 1000, tz=UTC)


def _json(v: Any) -> str:
    return json.dumps(to_plain(v), separators=(",", ":"), sort_keys=True, default=str)


def line_hash(line: str) -> int:
    return int.from_bytes(hashlib.sha1(line.encode()).digest()[:8], "big")


# -- declarations ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Json:
    """``field`` (or the whole event when empty) stored whole as a JSON string in ``column``."""

    column: str
    field: str = ""


@dataclass(frozen=True)
class Arrays:
    """A list of records stored as parallel arrays: ``columns`` maps column -> the records' field."""

    field: str
    columns: Mapping[str, str]


@dataclass(frozen=True)
class KeyValueArrays:
    """A ``dict[str, X]`` stored as two parallel arrays, keys sorted."""

    field: str
    keys: str
    values: str


@dataclass(frozen=True)
class Computed:
    """A column that is no field: ``fn(event)`` of Python type ``type`` (``meta``: its ``bounds``)."""

    column: str
    type: Any
    fn: Callable[[Any], Any]
    meta: Mapping[str, Any] = field(default_factory=dict)


Override = Json | Arrays | KeyValueArrays | Computed


@dataclass(frozen=True)
class TableSpec:
    """How one event type maps to one table: the defaults plus the declared exceptions."""

    table: str
    event: type[Event]
    #: a list field whose every item is a row (its fields are columns, next to the event's).
    rows_per: str = ""
    #: field path -> column name.
    rename: Mapping[str, str] = field(default_factory=dict)
    #: field paths with no column of their own (kept in a JSON column, or redundant).
    skip: tuple[str, ...] = ()
    #: columns that are not plain fields (a field they store has no default column of its own;
    #: computed columns are read from the event, once per event in a fan-out table).
    overrides: tuple[Override, ...] = ()


# -- derivation -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """One derived column: ``type`` is the Python type the value comes from (an enum is stored as
    its value, a bool as 0/1), ``meta`` the field's ``bounds`` metadata, ``get`` reads the value from
    the event, or from the item of a fan-out table when ``per_item``."""

    name: str
    type: Any
    meta: Mapping[str, Any]
    source: str
    get: Callable[[Any], Any]
    per_item: bool = False


def _optional_inner(tp: Any) -> Any | None:
    if typing.get_origin(tp) in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1 and len(typing.get_args(tp)) == 2:
            return inner[0]
    return None


def _is_scalar(tp: Any) -> bool:
    return tp in (str, int, float, bool) or (isinstance(tp, type) and issubclass(tp, enum.Enum))


def _convert(tp: Any) -> Callable[[Any], Any] | None:
    """Stored value from a field value of type ``tp`` (None: as is); TypeError if no default."""
    inner = _optional_inner(tp)
    if inner is not None:
        conv = _convert(inner)
        return None if conv is None else (lambda v: None if v is None else conv(v))
    if tp is bool:
        return int
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return operator.attrgetter("value")
    if _is_scalar(tp):
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, tuple) and _is_scalar(args[0]):
        item = _convert(args[0])
        return list if item is None else (lambda v: [item(x) for x in v])
    if origin is dict and args[1] is Any:
        return _json
    raise TypeError(f"no default column for {tp!r}")


def _getter(path: str, tp: Any) -> Callable[[Any], Any]:
    read = operator.attrgetter(path)
    conv = _convert(tp)
    return read if conv is None else (lambda obj: conv(read(obj)))


def _stored_type(tp: Any) -> Any:
    """A ``dict[str, Any]`` is stored as a JSON string; every other default keeps its type."""
    return str if typing.get_origin(tp) is dict else tp


def _sorted_values(d: Mapping[str, Any]) -> list[Any]:
    return [d[k] for k in sorted(d)]


def _list_of(tp: Any) -> Any:
    return types.GenericAlias(list, (tp,))


def _list_item(tp: Any) -> Any:
    if typing.get_origin(tp) not in (list, tuple):
        raise TypeError(f"{tp!r} is not a list")
    return typing.get_args(tp)[0]


class TableMap:
    """A :class:`TableSpec` compiled into its columns and a row mapper."""

    def __init__(self, spec: TableSpec) -> None:
        self.spec = spec
        self.table = spec.table
        self.event = spec.event
        self._fields: dict[str, tuple[Any, Mapping[str, Any]]] = {}  # every field path: type, meta
        self._index(spec.event, "")
        self._check_paths()
        consumed = set(spec.skip) | {
            o.field for o in spec.overrides if not isinstance(o, Computed) and o.field
        }
        self.columns: list[Column] = []
        for path, (tp, meta) in self._fields.items():
            if any(path == c or path.startswith(c + ".") for c in consumed):
                continue
            if path == spec.rows_per or dataclasses.is_dataclass(tp):
                continue  # walked: its fields are paths of their own
            self._add(self._field_column(path, tp, meta))
            if path == "ts_ms":
                self._add(Column("ts", datetime, {}, "ts_ms (as DateTime)", lambda e: ts(e.ts_ms)))
        for o in spec.overrides:
            for col in self._override_columns(o):
                self._add(col)
        self._event_cols = [(c.name, c.get) for c in self.columns if not c.per_item]
        self._item_cols = [(c.name, c.get) for c in self.columns if c.per_item]
        self._items = operator.attrgetter(spec.rows_per) if spec.rows_per else None

    # -- building ---------------------------------------------------------------------------------
    def _index(self, cls: Any, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            path, tp = prefix + f.name, hints[f.name]
            self._fields[path] = (tp, f.metadata)
            if dataclasses.is_dataclass(tp):
                self._index(tp, path + ".")
            elif path == self.spec.rows_per:
                self._index(_list_item(tp), path + ".")

    def _where(self, what: str) -> str:
        return f"{self.table} ({self.event.__name__}): {what}"

    def _check_paths(self) -> None:
        named = [*self.spec.rename, *self.spec.skip]
        named += [o.field for o in self.spec.overrides if not isinstance(o, Computed) and o.field]
        if self.spec.rows_per:
            named.append(self.spec.rows_per)
        unknown = [p for p in named if p not in self._fields]
        if unknown:
            raise TypeError(self._where(f"no field(s) {unknown}"))

    def _add(self, col: Column) -> None:
        if any(c.name == col.name for c in self.columns):
            raise TypeError(self._where(f"two columns named {col.name!r} (the second from {col.source})"))
        self.columns.append(col)

    def _relative(self, path: str) -> tuple[str, bool]:
        """The path to read from the event, or from an item of ``rows_per``."""
        prefix = self.spec.rows_per + "."
        if self.spec.rows_per and path.startswith(prefix):
            return path[len(prefix) :], True
        return path, False

    def _field_column(self, path: str, tp: Any, meta: Mapping[str, Any]) -> Column:
        rel, per_item = self._relative(path)
        name = self.spec.rename.get(path, path.rsplit(".", 1)[-1])
        try:
            get = _getter(rel, tp)
        except TypeError:
            raise TypeError(
                self._where(f"field {path!r} ({tp!r}) has no default column: declare how it is stored")
            ) from None
        return Column(name, _stored_type(tp), meta, path, get, per_item)

    def _override_columns(self, o: Override) -> list[Column]:
        if isinstance(o, Computed):
            return [Column(o.column, o.type, o.meta, f"computed {o.column}", o.fn)]
        if isinstance(o, Json):
            if not o.field:
                return [Column(o.column, str, {}, "the whole event", _json)]
            rel, per_item = self._relative(o.field)
            read = operator.attrgetter(rel)
            return [Column(o.column, str, {}, o.field, lambda obj: _json(read(obj)), per_item)]
        tp, _meta = self._fields[o.field]
        rel, per_item = self._relative(o.field)
        read = operator.attrgetter(rel)
        if isinstance(o, KeyValueArrays):
            key_tp, value_tp = typing.get_args(tp)
            return [
                Column(o.keys, _list_of(key_tp), {}, o.field, lambda obj: sorted(read(obj)), per_item),
                Column(
                    o.values, _list_of(value_tp), {}, o.field, lambda obj: _sorted_values(read(obj)), per_item
                ),
            ]
        record = _list_item(tp)  # Arrays
        hints = typing.get_type_hints(record)
        subs = {f.name: f for f in dataclasses.fields(record)}
        cols = []
        for column, sub in o.columns.items():
            if sub not in subs:
                raise TypeError(self._where(f"no field {o.field}.{sub}"))
            pick = _getter(sub, hints[sub])

            def get(obj: Any, pick: Callable[[Any], Any] = pick) -> list[Any]:
                return [pick(r) for r in read(obj)]

            meta = subs[sub].metadata
            cols.append(Column(column, _list_of(hints[sub]), meta, f"{o.field}.{sub}", get, per_item))
        return cols

    # -- mapping ----------------------------------------------------------------------------------
    def rows(self, event: Any) -> list[Row]:
        base = {name: get(event) for name, get in self._event_cols}  # once per event: one datetime per batch
        if self._items is None:
            return [base]
        return [base | {name: get(item) for name, get in self._item_cols} for item in self._items(event)]


# -- the tables -----------------------------------------------------------------------------------


def _top_frames(e: StackDump) -> list[str]:
    """The first 5 frames of the first thread with frames, as ``function (file:line)``."""
    main = next((t for t in e.threads if t.frames), None)
    return [f"{f.function} ({f.filename}:{f.line})" for f in (main.frames[:5] if main else [])]


SPECS: tuple[TableSpec, ...] = (
    TableSpec("gpu_samples", GpuSampleBatch, rows_per="gpus", rename={"gpus.index": "gpu"}),
    TableSpec(
        "host_samples",
        HostSample,
        overrides=(
            Arrays(
                "disks",
                {"disk_mounts": "mount", "disk_total_bytes": "total_bytes", "disk_used_bytes": "used_bytes"},
            ),
        ),
    ),
    TableSpec(
        "nic_samples",
        NicSampleBatch,
        rows_per="nics",
        rename={"nics.name": "nic"},
        overrides=(KeyValueArrays("nics.counters", keys="counter_names", values="counter_values"),),
    ),
    TableSpec(
        "heartbeats",
        Heartbeat,
        overrides=(
            Arrays("sources", {"source_names": "name", "source_ok": "ok", "source_errors": "error_count"}),
            Json("sources_json", "sources"),
            Arrays("nics_skipped", {"nics_skipped_names": "name", "nics_skipped_reasons": "reason"}),
        ),
    ),
    TableSpec("node_checks", NodeCheck),
    TableSpec("training_steps", TrainingStep),
    TableSpec(
        "log_lines",
        LogLine,
        overrides=(Computed("line_hash", int, lambda e: line_hash(e.line), bounds(0, 2**64 - 1)),),
    ),
    TableSpec("process_exits", ProcessExit),
    TableSpec("rank_liveness", RankLiveness),
    TableSpec(
        "stack_dumps",
        StackDump,
        overrides=(
            Computed("top_frames", list[str], _top_frames),
            Json("threads_json", "threads"),
            Json("process_tree_json", "process_tree"),
        ),
    ),
    TableSpec(
        "flight_recorder_dumps",
        FlightRecorderDump,
        overrides=(
            Json("groups_json", "groups"),
            Json("entries_json", "entries"),
            Computed("entry_count", int, lambda e: len(e.entries), bounds(0, 2**32 - 1)),
        ),
    ),
    TableSpec("detections", Detection),
    TableSpec("decisions", Decision),
    # The decision row has the group kind; an action event only names what it touched.
    TableSpec("action_events", ActionEvent, skip=("targets.group_kind",)),
    TableSpec("commands", Command),
    TableSpec("dead_letters", DeadLetter),
    TableSpec(
        "job_specs",
        JobSpec,
        rename={"topology.order": "rank_order"},
        # topology.job repeats job; overrides and positions are read from spec_json (the whole spec).
        skip=("topology.job", "overrides", "positions"),
        overrides=(Json("spec_json"),),
    ),
)

#: event class -> its compiled table mapping.
MAPS: dict[type[Event], TableMap] = {s.event: TableMap(s) for s in SPECS}

#: event class -> (table, flattener).
TABLES: dict[type[Event], tuple[str, Callable[[Any], list[Row]]]] = {
    cls: (m.table, m.rows) for cls, m in MAPS.items()
}

#: tables holding raw telemetry, pruned by day (``trainguard store prune``).
TELEMETRY_TABLES = (
    "gpu_samples",
    "host_samples",
    "nic_samples",
    "heartbeats",
    "training_steps",
    "log_lines",
    "process_exits",
    "rank_liveness",
    "stack_dumps",
    "flight_recorder_dumps",
)


def rows_by_table(events: list[Event]) -> dict[str, list[Row]]:
    """Group the rows of many events by destination table (one insert per table)."""
    out: dict[str, list[Row]] = {}
    for ev in events:
        table, flatten = TABLES[type(ev)]
        out.setdefault(table, []).extend(flatten(ev))
    return out
