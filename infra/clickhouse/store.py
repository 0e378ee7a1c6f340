"""ClickHouse access for TrainGuard: migrations, batched inserts, queries, retention.

Works against Debian's ClickHouse 18.16 (the embedded server) and modern ClickHouse (a
production cluster, or chDB in-process for tests) with the same SQL.  What 18.16 needs from
clickhouse-connect 1.6.0 is handled here once:

* inserts pass ``column_type_names`` (18.16's DESCRIBE has other columns than the client expects),
  read from ``system.columns`` and cached per table;
* HTTP compression is gzip (18.16 rejects lz4/zstd request bodies);
* parameters are bound client-side (``%(name)s``), never server-side ``{x:Type}``.

Every failure is a :class:`StoreError`; one of an insert says whether it is worth retrying
(:func:`insert_error_is_retryable`): ClickHouse away, busy or misconfigured -- retry the same
rows later -- or the rows themselves refused (a value out of its column's range, unparsable) --
retrying them can never succeed, so the sink isolates and dead-letters them instead.

Deduplication of inserts: ClickHouse's ``insert_deduplicate`` only applies to ``Replicated*``
tables (18.16: block checksums kept in ZooKeeper), and ``insert_deduplication_token`` (22.2+) does
not exist in 18.16 (its ``system.settings`` has no such setting).  On a cluster
(``clickhouse.cluster``, :mod:`trainguard.infra.clickhouse.cluster_ddl`) the tables are
``Replicated*``, so a batch retried as it was (an insert that failed after the server stored it)
has the same blocks and is stored once, whichever replica takes the retry.  No token could
catch a redelivery anyway: the sink's batches are cut differently when records are read again
(and split when one is bisected), so neither a block's checksum nor a per-batch token repeats.
Those duplicates are collapsed by the ``ReplacingMergeTree`` tables, keyed by each event's natural
key (read with ``FINAL``), on both topologies.
"""

from __future__ import annotations

import hashlib
import logging
import re
import struct
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from importlib import resources
from typing import Any

from trainguard.infra.clickhouse.cluster_ddl import ClusterDDL, ClusterDDLError, local_name
from trainguard.infra.clickhouse.rows import TELEMETRY_TABLES, Row, rows_by_table
from trainguard.infra.config import ClickHouseConfig
from trainguard.schemas.base import Event

_SPLIT = re.compile(r";\s*(?:\n|$)")
_COMMENT = re.compile(r"^\s*--.*$", re.MULTILINE)


class StoreError(RuntimeError):
    """ClickHouse is unreachable or rejected a statement (the message says which).

    ``retryable``: the same statement may succeed later (the server is down, busy, out of memory,
    or the schema is not migrated yet); false when the data itself is refused, so retrying it is
    pointless (only inserts say so).  ``code``: ClickHouse's error code when known.
    """

    def __init__(self, message: str, *, retryable: bool = True, code: int | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.code = code


# -- what a failed insert means -------------------------------------------------------------------

#: ClickHouse error codes that refuse the inserted *rows*: the same rows fail every time, other rows
#: of the batch would go in.  Every other code is retryable: the server away or busy (209
#: SOCKET_TIMEOUT, 210 NETWORK_ERROR, 241 MEMORY_LIMIT_EXCEEDED, 252 TOO_MANY_PARTS, 202
#: TOO_MANY_SIMULTANEOUS_QUERIES, 159 TIMEOUT_EXCEEDED, 242 TABLE_IS_READ_ONLY, 319
#: UNKNOWN_STATUS_OF_INSERT, ...), or a schema or access problem that is no row's fault (60
#: UNKNOWN_TABLE, 16 NO_SUCH_COLUMN_IN_TABLE, 81 UNKNOWN_DATABASE, 516 AUTHENTICATION_FAILED,
#: 164 READONLY, ...): dead-lettering every row until someone runs the migrations would be worse
#: than waiting for them.  An unknown code waits too: a stall shows in the metrics, a wrongly
#: dead-lettered batch would not.
ROW_REJECT_CODES: dict[int, str] = {
    6: "CANNOT_PARSE_TEXT",
    25: "CANNOT_PARSE_ESCAPE_SEQUENCE",
    26: "CANNOT_PARSE_QUOTED_STRING",
    27: "CANNOT_PARSE_INPUT_ASSERTION_FAILED",
    38: "CANNOT_PARSE_DATE",
    41: "CANNOT_PARSE_DATETIME",
    43: "ILLEGAL_TYPE_OF_ARGUMENT",
    53: "TYPE_MISMATCH",
    69: "ARGUMENT_OUT_OF_BOUND",
    70: "CANNOT_CONVERT_TYPE",
    72: "CANNOT_PARSE_NUMBER",
    117: "INCORRECT_DATA",
    128: "TOO_LARGE_ARRAY_SIZE",
    130: "CANNOT_READ_ARRAY_FROM_TEXT",
    131: "TOO_LARGE_STRING_SIZE",
    190: "SIZES_OF_ARRAYS_DOESNT_MATCH",
    321: "VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE",
    349: "CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN",
    376: "CANNOT_PARSE_UUID",
    395: "FUNCTION_THROW_IF_VALUE_IS_NON_ZERO",
    467: "CANNOT_PARSE_BOOL",
    469: "VIOLATED_CONSTRAINT",
    691: "UNKNOWN_ELEMENT_OF_ENUM",
}

#: Messages that refuse a batch for its *shape*, under a code that is otherwise retryable: rows
#: spread over too many partitions (code 252, as "too many parts").  Smaller batches go in, so
#: they are treated as row rejects: the sink's bisection splits the batch until they do.
BATCH_REJECT_MESSAGES = ("Too many partitions for single INSERT block",)

#: Python exceptions raised while the client serializes the rows (a value out of its column's
#: range, a lone surrogate in a string, a string in an Int32 column): the row's fault.
_SERIALIZATION_ERRORS: tuple[type[BaseException], ...] = (
    ArithmeticError,
    ValueError,  # UnicodeEncodeError too
    TypeError,
    LookupError,
    AttributeError,
    struct.error,
)

_CODE = re.compile(r"\bCode: (\d+)")


def error_code(exc: BaseException) -> int | None:
    """ClickHouse's error code of ``exc``: clickhouse-connect's ``code`` (from the
    ``X-ClickHouse-Exception-Code`` header, or chDB), else ``Code: N`` in the server's text (18.16
    sends no such header)."""
    code = getattr(exc, "code", None)
    if isinstance(code, int) and not isinstance(code, bool):
        return code
    m = _CODE.search(str(exc))
    return int(m.group(1)) if m else None


def insert_error_is_retryable(exc: BaseException) -> bool:
    """Whether an insert that raised ``exc`` may succeed if tried again with the same rows.

    False for a refusal of the data: a ClickHouse code of :data:`ROW_REJECT_CODES`, a message of
    :data:`BATCH_REJECT_MESSAGES`, or the client failing to serialize a value (clickhouse-connect's
    ``DataError`` without a server code, or the Python error it re-raises).  True for everything
    else: connection refused or reset, timeouts, HTTP 429/502/503/504, memory or part limits,
    schema and access errors, codes not listed.
    """
    if isinstance(exc, StoreError):
        return exc.retryable
    from clickhouse_connect.driver import exceptions as ch

    if isinstance(exc, ch.OperationalError):  # transport failures, retried 429/503/504 responses
        return True
    if isinstance(exc, ch.ClickHouseError):
        text = str(exc)
        if any(m in text for m in BATCH_REJECT_MESSAGES):
            return False
        code = error_code(exc)
        if code is not None:
            return code not in ROW_REJECT_CODES
        return not isinstance(exc, ch.DataError)  # DataError without a code: a value it cannot write
    if isinstance(exc, OSError):  # ConnectionError, TimeoutError, a chDB temp file on a full disk
        return True
    return not isinstance(exc, _SERIALIZATION_ERRORS)


def describe_error(exc: BaseException, depth: int = 3) -> str:
    """``exc``'s text with the exceptions that caused it (clickhouse-connect's "Unable to create
    native array for column `ranks`: error" says why only in its cause)."""
    from clickhouse_connect.driver.exceptions import ClickHouseError

    if isinstance(exc, ClickHouseError | StoreError):
        own = str(exc)
    else:
        kind, name = type(exc), type(exc).__qualname__
        own = f"{name if kind.__module__ == 'builtins' else f'{kind.__module__}.{name}'}: {exc}"
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if cause is not None and depth > 1:
        more = describe_error(cause, depth - 1)
        if more and str(cause) not in own:
            own = f"{own} (caused by {more})"
    return own


class _DemoteSerializationErrors(logging.Filter):
    """clickhouse-connect logs a value it cannot serialize with a traceback at ERROR, then raises
    it; :meth:`ClickHouseStore.insert_rows` raises it again as a :class:`StoreError` with the cause,
    and the sink bisects a batch around such a row (two failed inserts per halving), so the log
    line becomes DEBUG here."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Error serializing column"):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


logging.getLogger("clickhouse_connect.driver.transform").addFilter(_DemoteSerializationErrors())


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
    folder = resources.files("trainguard.infra.clickhouse") / "migrations"
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


def _tls_hint(exc: BaseException) -> str:
    """What to change when the HTTPS handshake failed on a certificate."""
    text = str(exc)
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return (
            " -- the server certificate failed verification (a CA not trusted here, or a host name "
            "it does not cover): set clickhouse.ca_file to the CA that signed it, connect by a name "
            "in the certificate, or (test servers only) set clickhouse.verify: false"
        )
    if "CERTIFICATE_REQUIRED" in text:
        return " -- the server requires a client certificate: set clickhouse.cert_file and key_file"
    return ""


class ClickHouseStore:
    """A connection to the TrainGuard database plus the operations the project needs."""

    def __init__(self, cfg: ClickHouseConfig) -> None:
        self.cfg = cfg
        self._client: Any = None
        self._columns: dict[str, tuple[list[str], list[str]]] = {}

    # -- connection -------------------------------------------------------------------------
    def _connect(self, database: str | None) -> Any:
        import clickhouse_connect

        kwargs = self.cfg.client_kwargs(database or "")  # a missing TLS file: ConfigError, as is
        try:
            return clickhouse_connect.get_client(**kwargs)
        except Exception as exc:  # clickhouse-connect raises several unrelated types here
            msg = f"cannot connect to ClickHouse at {self.cfg.url}: {exc}{_tls_hint(exc)}"
            raise StoreError(msg) from exc

    @property
    def client(self) -> Any:
        if self._client is None:
            self.ensure_database()
            self._client = self._connect(self.cfg.database)
        return self._client

    def ensure_database(self) -> None:
        admin = self._connect(None)
        sql = f"CREATE DATABASE IF NOT EXISTS {self.cfg.database}"
        try:
            if self.cfg.cluster:
                # ON CLUSTER waits for every server: only when it is missing here, so a client of a
                # cluster with one replica down still connects.
                found = admin.command(
                    "SELECT count() FROM system.databases WHERE name = %(db)s",
                    parameters={"db": self.cfg.database},
                )
                sql = "" if int(found) else self._ddl().create_database()
            if sql:
                admin.command(sql)
        except Exception as exc:
            raise StoreError(
                f"cannot create database {self.cfg.database!r}: {exc}{self._cluster_hint(exc)}"
            ) from exc
        finally:
            if not self.cfg.dsn:  # a chdb session is process-wide: closing it ends it
                admin.close()

    def close(self) -> None:
        if self._client is not None and not self.cfg.dsn:
            self._client.close()
        self._client = None

    def reset(self) -> None:
        """After a failure: reconnect on next use and reread the tables' columns (a migration may
        have run meanwhile).  A chDB session is process-wide and kept."""
        self._columns.clear()
        if not self.cfg.dsn:
            self.close()

    def ping(self) -> bool:
        try:
            return bool(self.query("SELECT 1")[0][0] == 1)
        except StoreError:
            return False

    # -- migrations -------------------------------------------------------------------------
    def _ddl(self) -> ClusterDDL:
        return ClusterDDL(self.cfg.cluster, self.cfg.database)

    def _cluster_hint(self, exc: BaseException) -> str:
        """What to check when a statement ``ON CLUSTER`` failed (nothing on one server)."""
        if not self.cfg.cluster:
            return ""
        code = error_code(exc)
        if code == 170:  # BAD_GET: no such cluster in remote_servers
            return f" -- clickhouse.cluster {self.cfg.cluster!r} is no cluster of the server's remote_servers"
        if code == 159 or "distributed_ddl_task_timeout" in str(exc):
            return (
                f" -- a server of cluster {self.cfg.cluster!r} did not run the statement in time: "
                "is every replica up, and ZooKeeper?"
            )
        if code in (225, 999):  # NO_ZOOKEEPER, KEEPER_EXCEPTION
            return " -- the server cannot reach ZooKeeper (its <zookeeper> section)"
        return ""

    def _run_ddl(self, statements: list[str]) -> None:
        """Run one migration's statements, each rendered for the cluster when there is one."""
        for stmt in statements:
            try:
                self.client.command(stmt)
            except Exception as exc:
                raise StoreError(
                    f"ClickHouse rejected statement: {exc}{self._cluster_hint(exc)}\n{stmt[:300]}"
                ) from exc

    def applied_migrations(self) -> dict[int, str]:
        if self.cfg.cluster:
            exists = self.query(
                "SELECT count() FROM system.tables WHERE database = %(db)s AND name = 'schema_migrations'",
                {"db": self.cfg.database},
            )[0][0]
            if not exists:  # ON CLUSTER only when missing: `stack status` with a replica down still works
                self._run_ddl(self._ddl().render(_MIGRATIONS_DDL))
        else:
            self.command(_MIGRATIONS_DDL)
        rows = self.query(
            "SELECT version, argMax(checksum, applied_at) FROM schema_migrations GROUP BY version"
        )
        return {int(v): str(c) for v, c in rows}

    def migrate(self) -> list[Migration]:
        """Apply the migrations not yet recorded; return those applied now (idempotent)."""
        applied = self.applied_migrations()
        done = []
        ddl = self._ddl()
        for mig in load_migrations():
            try:
                # Rendered even when applied: an ALTER on a cluster needs its table's sharding key.
                statements = (
                    [s for stmt in mig.statements() for s in ddl.render(stmt)]
                    if ddl.cluster
                    else mig.statements()
                )
            except ClusterDDLError as exc:
                raise StoreError(f"migration {mig.version:04d}_{mig.name}: {exc}") from exc
            if mig.version in applied:
                if applied[mig.version] != mig.checksum:
                    raise StoreError(
                        f"migration {mig.version:04d}_{mig.name} changed after it was applied "
                        f"(recorded {applied[mig.version]}, file {mig.checksum}); add a new migration instead"
                    )
                continue
            self._run_ddl(statements)
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

    def query_with_columns(
        self, sql: str, parameters: dict[str, Any] | None = None
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """(column names, rows): the names even when no row came back."""
        try:
            res = self.client.query(sql, parameters=parameters)
        except Exception as exc:
            raise StoreError(f"ClickHouse query failed: {exc}\n{sql[:300]}") from exc
        return list(res.column_names), [tuple(r) for r in res.result_rows]

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
        try:
            data = [[row[n] for n in names] for row in rows]
        except KeyError as exc:  # rows of one table always have the same columns: a mapper bug
            raise StoreError(f"rows for {table} lack column {exc}") from exc
        client = self.client  # connecting may fail: a retryable StoreError of its own
        try:
            client.insert(table, data, column_names=names, column_type_names=types)
        except Exception as exc:
            raise StoreError(
                f"insert into {table} failed: {describe_error(exc)}",
                retryable=insert_error_is_retryable(exc),
                code=error_code(exc),
            ) from exc
        return len(rows)

    def insert_events(self, events: list[Event]) -> dict[str, int]:
        """Insert events into their tables, one batch per table; returns rows per table."""
        return {t: self.insert_rows(t, rows) for t, rows in rows_by_table(events).items()}

    def count(self, table: str, where: str = "1", parameters: dict[str, Any] | None = None) -> int:
        """Distinct rows (after dedup: FINAL) matching ``where``."""
        return int(self.query(f"SELECT count() FROM {table} FINAL WHERE {where}", parameters)[0][0])

    # -- retention --------------------------------------------------------------------------
    def storage_table(self, table: str) -> str:
        """The table that holds ``table``'s parts: itself, or on a cluster its replicated ``_local``
        table (the Distributed one has none)."""
        return local_name(table) if self.cfg.cluster else table

    def partitions(self, table: str) -> list[str]:
        rows = self.query(
            "SELECT DISTINCT partition FROM system.parts "
            "WHERE database = %(db)s AND table = %(t)s AND active",
            {"db": self.cfg.database, "t": self.storage_table(table)},
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
                    # On a cluster: the replicated table, on every shard (a replica drops it for all).
                    where = (
                        f"{self.storage_table(table)} ON CLUSTER {self.cfg.cluster}"
                        if self.cfg.cluster
                        else table
                    )
                    self.command(f"ALTER TABLE {where} DROP PARTITION '{day.isoformat()}'")
                    dropped.append((table, part))
        return dropped


def _partition_day(partition: str) -> date | None:
    """system.parts shows a Date partition as ``20261122`` (18.16) or ``2026-11-22`` (modern)."""
    digits = partition.strip("'").replace("-", "")
    try:
        return datetime.strptime(digits, "%Y%m%d").date()
    except ValueError:
        return None
