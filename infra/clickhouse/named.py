"""Named SQL queries: the operator's postmortem questions, one ``.sql`` file each.

Each file in ``infra/clickhouse/queries/`` starts with a header of ``--`` comment lines::

    -- name: mttr_by_category
    -- answers: Mean and worst time to recover, per fault category, for one job.
    -- param: job String                 the job
    -- param: since_ms Int64 = 0          only incidents decided at or after this Unix time (ms)

then the query, which names its parameters ``%(name)s`` (bound and quoted by the client: the
server-side ``{name:Type}`` form does not exist on ClickHouse 18.16, and every query also runs on
modern ClickHouse through chDB).  A parameter with ``= default`` is optional.  ``{{other}}`` in a
query stands for the query named ``other`` (as a subquery: ``FROM ({{incidents}})``), so a
summary over incidents counts exactly what ``incidents`` lists; the included query's parameters
are the includer's where it declares them again, and keep their defaults where it does not.
``trainguard sql``,
``trainguard postmortem`` and ``trainguard report`` all read these files, so the numbers an
operator gets from the CLI, the report and a hand-run query are the same numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainguard.infra.clickhouse.store import ClickHouseStore

#: the parameter types a header may declare, and how a command-line string becomes one.
_PARSERS: dict[str, Any] = {
    "String": str,
    "Int64": int,
    "Int32": int,
    "UInt32": int,
    "Float64": float,
    "Array(String)": lambda s: [p for p in (x.strip() for x in s.split(",")) if p],
}
_HEADER = re.compile(r"^--\s*(name|answers|param):\s*(.*)$")
_PARAM = re.compile(r"^(\w+)\s+(String|Int64|Int32|UInt32|Float64|Array\(String\))(?:\s*=\s*(\S+))?\s*(.*)$")
_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
_INCLUDE = re.compile(r"\{\{(\w+)\}\}")


class QueryError(ValueError):
    """A query file that does not parse, an unknown query, or a bad parameter."""


@dataclass(frozen=True)
class Param:
    name: str
    type: str
    default: str | None  # None: required
    help: str

    def parse(self, raw: str) -> Any:
        try:
            return _PARSERS[self.type](raw)
        except ValueError as exc:
            raise QueryError(f"parameter {self.name}: {raw!r} is not a {self.type}") from exc


@dataclass(frozen=True)
class NamedQuery:
    name: str
    answers: str
    params: tuple[Param, ...]
    sql: str  # the query, header removed
    text: str  # the whole file, as `sql show` prints it
    #: parameters of included queries this one does not declare: always their defaults.
    fixed: tuple[Param, ...] = ()

    def bind(self, given: dict[str, Any]) -> dict[str, Any]:
        """Parameters for the client: ``given`` (strings from a command line are parsed to the
        declared types; Python values pass as they are) plus defaults; unknown or missing
        parameters are errors that name what the query takes."""
        known = {p.name: p for p in self.params}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise QueryError(
                f"query {self.name} has no parameter {', '.join(unknown)}; it takes {self.usage()}"
            )
        out: dict[str, Any] = {}
        for p in self.params:
            if p.name in given:
                v = given[p.name]
                out[p.name] = p.parse(v) if isinstance(v, str) and p.type != "String" else v
            elif p.default is not None:
                out[p.name] = p.parse("" if p.default == "''" else p.default)
            else:
                raise QueryError(f"query {self.name} needs --param {p.name}=... ({p.type}: {p.help})")
        for p in self.fixed:
            out[p.name] = p.parse("" if p.default == "''" else str(p.default))
        return out

    def usage(self) -> str:
        return (
            " ".join(
                f"{p.name}={p.type}" if p.default is None else f"[{p.name}={p.default}]" for p in self.params
            )
            or "no parameters"
        )

    def run(self, store: ClickHouseStore, **params: Any) -> list[dict[str, Any]]:
        return store.query_dicts(self.sql, self.bind(params))

    def run_rows(self, store: ClickHouseStore, **params: Any) -> tuple[list[str], list[tuple[Any, ...]]]:
        """(column names, rows): the columns even when no row came back."""
        return store.query_with_columns(self.sql, self.bind(params))


def parse(text: str, source: str = "<query>") -> NamedQuery:
    """One query file's text -> :class:`NamedQuery` (QueryError says what is wrong and where)."""
    meta: dict[str, str] = {}
    params: list[Param] = []
    body: list[str] = []
    in_header = True
    for line in text.splitlines():
        m = _HEADER.match(line.strip()) if in_header else None
        if m:
            key, value = m.group(1), m.group(2).strip()
            if key == "param":
                pm = _PARAM.match(value)
                if pm is None:
                    raise QueryError(f"{source}: bad param line {value!r} (want: NAME TYPE [= DEFAULT] HELP)")
                params.append(Param(pm.group(1), pm.group(2), pm.group(3), pm.group(4).strip()))
            elif key == "answers" and "answers" in meta:
                meta["answers"] += " " + value
            else:
                meta[key] = value
            continue
        if in_header and (not line.strip() or line.strip().startswith("--")):
            continue  # a blank line or a free comment in the header
        in_header = False
        body.append(line)
    for key in ("name", "answers"):
        if not meta.get(key):
            raise QueryError(f"{source}: header has no '-- {key}:' line")
    sql = "\n".join(body).strip().rstrip(";")
    if not sql:
        raise QueryError(f"{source}: no query after the header")
    return NamedQuery(meta["name"], meta["answers"], tuple(params), sql, text)


def _expand(q: NamedQuery, queries: dict[str, NamedQuery], seen: tuple[str, ...] = ()) -> NamedQuery:
    """``q`` with its ``{{other}}`` includes replaced, its parameters checked against its header."""
    inherited: dict[str, Param] = {}

    def include(m: re.Match[str]) -> str:
        name = m.group(1)
        if name in seen or name == q.name:
            raise QueryError(f"query {q.name}: includes itself through {name}")
        if name not in queries:
            raise QueryError(f"query {q.name}: includes {{{{{name}}}}}, which is no query")
        sub = _expand(queries[name], queries, (*seen, q.name))
        for p in (*sub.params, *sub.fixed):
            inherited.setdefault(p.name, p)
        return sub.sql

    sql = _INCLUDE.sub(include, q.sql)
    declared = {p.name for p in q.params}
    fixed = tuple(p for name, p in sorted(inherited.items()) if name not in declared)
    required = [p.name for p in fixed if p.default is None]
    if required:
        raise QueryError(f"query {q.name}: must declare {required} (required by a query it includes)")
    used = set(_PLACEHOLDER.findall(sql))
    if used != declared | {p.name for p in fixed}:
        raise QueryError(
            f"query {q.name}: parameters used {sorted(used)} but declared {sorted(declared)} "
            "(they must match)"
        )
    return NamedQuery(q.name, q.answers, q.params, sql, q.text, fixed)


def _files(directory: Path | None) -> list[tuple[str, str]]:
    if directory is not None:
        return [(str(p), p.read_text()) for p in sorted(directory.glob("*.sql"))]
    root = resources.files("trainguard.infra.clickhouse") / "queries"
    return sorted((f.name, f.read_text()) for f in root.iterdir() if f.name.endswith(".sql"))


def load_all(directory: Path | None = None) -> dict[str, NamedQuery]:
    """Every named query, by name (the package's own, or those in ``directory``)."""
    raw: dict[str, NamedQuery] = {}
    for source, text in _files(directory):
        q = parse(text, source)
        if q.name in raw:
            raise QueryError(f"{source}: a second query named {q.name!r}")
        raw[q.name] = q
    return {name: _expand(q, raw) for name, q in raw.items()}


def get(name: str) -> NamedQuery:
    queries = load_all()
    if name not in queries:
        raise QueryError(f"no query named {name!r}; there are: {', '.join(sorted(queries))}")
    return queries[name]
