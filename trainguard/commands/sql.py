"""``trainguard sql``: the named postmortem queries (``infra/clickhouse/queries/*.sql``).

``sql list`` names them and what each answers, ``sql show NAME`` prints the file (header and SQL:
copy it into ``clickhouse-client`` to adapt it), ``sql run NAME --param job=J`` runs it on the
configured ClickHouse and prints a table, JSON lines or CSV.  ``--since 6h`` (or an ISO time) sets
``since_ms`` for the queries that take it.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import re
import sys
from typing import Any

import click

from trainguard.context import friendly_errors, settings
from trainguard.infra.clickhouse import named
from trainguard.infra.clickhouse.named import QueryError
from trainguard.infra.clickhouse.store import ClickHouseStore

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def since_ms(value: str, now: dt.datetime | None = None) -> int:
    """``30m`` / ``6h`` / ``2d`` ago, or an ISO time (UTC unless it says otherwise), as Unix ms.

    >>> since_ms("2h", dt.datetime(2026, 1, 1, 12, tzinfo=dt.UTC))
    1767261600000
    >>> since_ms("2026-01-01T10:00:00")
    1767261600000
    """
    m = _DURATION.match(value.strip())
    if m:
        now = now or dt.datetime.now(dt.UTC)
        return int((now.timestamp() - float(m.group(1)) * _UNIT_S[m.group(2)]) * 1000)
    try:
        t = dt.datetime.fromisoformat(value.strip())
    except ValueError as exc:
        raise click.BadParameter(f"{value!r}: want a duration (30m, 6h, 2d) or an ISO time") from exc
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return int(t.timestamp() * 1000)


def _cell(col: str, v: Any, human: bool) -> str:
    if v is None:
        return "-" if human else ""
    if human and (col == "ts_ms" or col.endswith("_ts_ms")) and isinstance(v, int):
        if v <= 0:
            return "-"  # no such time (a recovery that has not ended)
        return dt.datetime.fromtimestamp(v / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    if isinstance(v, list | tuple):
        return ",".join(str(x) for x in v)
    if isinstance(v, float):
        return f"{v:.4g}" if human else repr(v)
    return str(v)


def print_table(cols: list[str], rows: list[tuple[Any, ...]], width: int = 60) -> None:
    cells = [[_cell(c, v, True) for c, v in zip(cols, r, strict=True)] for r in rows]
    cells = [[x if len(x) <= width else x[: width - 1] + "…" for x in r] for r in cells]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
    click.echo("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip())
    click.echo("  ".join("-" * w for w in widths))
    for r in cells:
        click.echo("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip())
    click.echo(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")


def _jsonable(v: Any) -> Any:
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and v != v:  # NaN is not JSON
        return None
    if isinstance(v, dt.datetime | dt.date):
        return v.isoformat()
    return v


@click.group()
def sql() -> None:
    """The named postmortem queries: list, show, run."""


@sql.command("list")
def list_queries() -> None:
    """Every named query, its parameters and what it answers."""
    for q in named.load_all().values():
        click.echo(f"{click.style(q.name, bold=True)}  {q.usage()}")
        click.echo(f"    {q.answers}")


@sql.command("show")
@click.argument("name")
@friendly_errors
def show(name: str) -> None:
    """Print a query's file: its header and SQL."""
    try:
        click.echo(named.get(name).text.rstrip())
    except QueryError as exc:
        raise click.ClickException(str(exc)) from exc


@sql.command("run")
@click.argument("name")
@click.option("--param", "-p", "params", multiple=True, metavar="NAME=VALUE", help="A query parameter.")
@click.option(
    "--since", "since", default=None, help="Sets since_ms: a duration ago (30m, 6h, 2d) or an ISO time."
)
@click.option(
    "--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True
)
@click.pass_context
@friendly_errors
def run(ctx: click.Context, name: str, params: tuple[str, ...], since: str | None, fmt: str) -> None:
    """Run a named query on the configured ClickHouse."""
    given: dict[str, Any] = {}
    for p in params:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{p!r}: want NAME=VALUE", param_hint="--param")
        given[key.strip()] = value
    try:
        q = named.get(name)
        if since is not None:
            if "since_ms" not in {p.name for p in q.params}:
                raise QueryError(f"query {name} takes no since_ms (it takes {q.usage()})")
            given["since_ms"] = str(since_ms(since))
        bound = q.bind(given)
    except QueryError as exc:
        raise click.ClickException(str(exc)) from exc
    store = ClickHouseStore(settings(ctx).clickhouse)
    try:
        cols, rows = store.query_with_columns(q.sql, bound)
    finally:
        store.close()
    if fmt == "json":
        for r in rows:
            click.echo(json.dumps({c: _jsonable(v) for c, v in zip(cols, r, strict=True)}))
    elif fmt == "csv":
        w = csv.writer(sys.stdout)
        if cols:
            w.writerow(cols)
        for r in rows:
            w.writerow([_cell(c, v, False) for c, v in zip(cols, r, strict=True)])
    elif rows:
        print_table(cols, rows)
    else:
        click.echo("(no rows)")


COMMANDS = [sql]
