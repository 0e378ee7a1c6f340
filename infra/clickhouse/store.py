"""ClickHouse access for TrainGuard: migrations, batched inserts, queries, retention.

Works against Debian's ClickHouse 18.16 (the embedded server) and modern ClickHouse (a
production cluster, or chDB in-process for tests) with the same SQL.  What 18.16 needs from
clickhouse-connect 1.6.0 is handled here once:

* inserts pass ``column_type_names`` (18.16's DESCRIBE has other columns than the client expects),
  read from ``system.columns`` and cached per table;
* HTTP compression is gzip (18.16 rejects lz4/zstd request bodies);
* parameters are bound client-side (``%(name)s``), never server-side ``{x:Type}``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from importlib import resources
from typing import Any

from infra.clickhouse.rows import TELEMETRY_TABLES, Row, rows_by_table
from infra.config import ClickHouseConfig
from schemas.base import Event

_SPLIT = re.compile(r";\s*(?:\n|$)")
_COMMENT = re.compile(r"^\s*--.*$", re.MULTILINE)


class StoreError(RuntimeError):
    """ClickHouse is unreachable or rejected a statement (the message says which)."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()[:16]

    def statements(self) -> list[str]:
        body = _COMMENT.sub("", self.sql)
        return [s.strip() for s in _SPLIT.split(body) if s.strip()]


def load_migrations() -> list[Migration]:
    """Numbered ``NNNN_name.sql`` files of ``infra/clickhouse/migrations``, in order."""
    folder = resources.files("infra.clickhouse") / "migrations"
    out = []
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        m = re.fullmatch(r"(\d{4})_(\w+)\.sql", entry.name)
        if m:
            out.append(Migration(int(m.group(1)), m.group(2), entry.read_text(encoding="utf-8")))
    versions = [m.version for m in out]
    if len(set(versions)) != len(versions):
        raise StoreError(f"duplicate migration numbers in {folder}: {versions}")
    return out


_MIGRATIONS_DDL = """CREATE TABLE IF NOT EXISTS schema_migrations
(
    version UInt32,
    name String,
    checksum String,
    applied_at DateTime('UTC')
)
ENGINE = ReplacingMergeTree()
ORDER BY version"""


class ClickHouseStore:
    """A connection to the TrainGuard database plus the operations the project needs."""

    def __init__(self, cfg: ClickHouseConfig) -> None:
        self.cfg = cfg
        self._client: Any = None
        self._columns: dict[str, tuple[list[str], list[str]]] = {}

    # -- connection -------------------------------------------------------------------------
    def _connect(self, database: str | None) -> Any:
        import clickhouse_connect

        try:
            if self.cfg.dsn:
                return clickhouse_connect.get_client(dsn=self.cfg.dsn, database=database or "")
            return clickhouse_connect.get_client(
                host=self.cfg.host,
                port=self.cfg.port,
                username=self.cfg.username,
                password=self.cfg.password,
                secure=self.cfg.secure,
                database=database or "",
                connect_timeout=self.cfg.connect_timeout_s,
                compress="gzip",
            )
        except Exception as exc:  # clickhouse-connect raises several unrelated types here
            raise StoreError(f"cannot connect to ClickHouse at {self.cfg.url}: {exc}") from exc

    @property
    def client(self) -> Any:
        if self._client is None:
            self.ensure_database()
            self._client = self._connect(self.cfg.database)
        return self._client

    def ensure_database(self) -> None:
        admin = self._connect(None)
        try:
            admin.command(f"CREATE DATABASE IF NOT EXISTS {self.cfg.database}")
        except Exception as exc:
            raise StoreError(f"cannot create database {self.cfg.database!r}: {exc}") from exc
        finally:
            if not self.cfg.dsn:  # a chdb session is process-wide: closing it ends it
                admin.close()

    def close(self) -> None:
        if self._client is not None and not self.cfg.dsn:
            self._client.close()
        self._client = None

    def ping(self) -> bool:
        try:
            return bool(self.query("SELECT 1")[0][0] == 1)
        except StoreError:
            return False

    # -- migrations -------------------------------------------------------------------------
    def applied_migrations(self) -> dict[int, str]:
        self.command(_MIGRATIONS_DDL)
        rows = self.query(
            "SELECT version, argMax(checksum, applied_at) FROM schema_migrations GROUP BY version"
        )
        return {int(v): str(c) for v, c in rows}

    def migrate(self) -> list[Migration]:
        """Apply the migrations not yet recorded; return those applied now (idempotent)."""
        applied = self.applied_migrations()
        done = []
        for mig in load_migrations():
            if mig.version in applied:
                if applied[mig.version] != mig.checksum:
                    raise StoreError(
                        f"migration {mig.version:04d}_{mig.name} changed after it was applied "
                        f"(recorded {applied[mig.version]}, file {mig.checksum}); add a new migration instead"
                    )
                continue
            for stmt in mig.statements():
                self.command(stmt)
            self.insert_rows(
                "schema_migrations",
                [
                    {
                        "version": mig.version,
                        "name": mig.name,
                        "checksum": mig.checksum,
                        "applied_at": datetime.now(tz=UTC).replace(microsecond=0),
                    }
                ],
            )
            done.append(mig)
        return done

    # -- statements -------------------------------------------------------------------------
    def command(self, sql: str, parameters: dict[str, Any] | None = None) -> None:
        try:
            self.client.command(sql, parameters=parameters)
        except Exception as exc:
            raise StoreError(f"ClickHouse rejected statement: {exc}\n{sql[:300]}") from exc

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        try:
            return [tuple(r) for r in self.client.query(sql, parameters=parameters).result_rows]
        except Exception as exc:
            raise StoreError(f"ClickHouse query failed: {exc}\n{sql[:300]}") from exc

    def query_dicts(self, sql: str, parameters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        try:
            res = self.client.query(sql, parameters=parameters)
        except Exception as exc:
            raise StoreError(f"ClickHouse query failed: {exc}\n{sql[:300]}") from exc
        return [dict(zip(res.column_names, row, strict=True)) for row in res.result_rows]

    # -- inserts ----------------------------------------------------------------------------
    def columns(self, table: str) -> tuple[list[str], list[str]]:
        if table not in self._columns:
            rows = self.query(
                "SELECT name, type FROM system.columns WHERE database = %(db)s AND table = %(t)s",
                {"db": self.cfg.database, "t": table},
            )
            if not rows:
                raise StoreError(
                    f"table {self.cfg.database}.{table} does not exist (run `trainguard migrate`)"
                )
            self._columns[table] = ([r[0] for r in rows], [r[1] for r in rows])
        return self._columns[table]

    def insert_rows(self, table: str, rows: list[Row]) -> int:
        if not rows:
            return 0
        names, types = self.columns(table)
        missing = set(names) - set(rows[0])
        if missing:
            raise StoreError(f"rows for {table} lack columns {sorted(missing)}")
        data = [[row[n] for n in names] for row in rows]
        try:
            self.client.insert(table, data, column_names=names, column_type_names=types)
        except Exception as exc:
            raise StoreError(f"insert into {table} failed: {exc}") from exc
        return len(rows)

    def insert_events(self, events: list[Event]) -> dict[str, int]:
        """Insert events into their tables, one batch per table; returns rows per table."""
        return {t: self.insert_rows(t, rows) for t, rows in rows_by_table(events).items()}

    def count(self, table: str, where: str = "1", parameters: dict[str, Any] | None = None) -> int:
        """Distinct rows (after dedup: FINAL) matching ``where``."""
        return int(self.query(f"SELECT count() FROM {table} FINAL WHERE {where}", parameters)[0][0])

    # -- retention --------------------------------------------------------------------------
    def partitions(self, table: str) -> list[str]:
        rows = self.query(
            "SELECT DISTINCT partition FROM system.parts "
            "WHERE database = %(db)s AND table = %(t)s AND active",
            {"db": self.cfg.database, "t": table},
        )
        return sorted(str(r[0]) for r in rows)

    def prune(self, keep_days: int, today: date | None = None) -> list[tuple[str, str]]:
        """Drop daily partitions of raw telemetry older than ``keep_days``; returns what it dropped."""
        cutoff = (today or datetime.now(tz=UTC).date()) - timedelta(days=keep_days)
        dropped = []
        for table in TELEMETRY_TABLES:
            for part in self.partitions(table):
                day = _partition_day(part)
                if day is not None and day < cutoff:
                    self.command(f"ALTER TABLE {table} DROP PARTITION '{day.isoformat()}'")
                    dropped.append((table, part))
        return dropped


def _partition_day(partition: str) -> date | None:
    """system.parts shows a Date partition as ``20261122`` (18.16) or ``2026-11-22`` (modern)."""
    digits = partition.strip("'").replace("-", "")
    try:
        return datetime.strptime(digits, "%Y%m%d").date()
    except ValueError:
        return None
