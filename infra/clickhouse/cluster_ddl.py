"""The migrations' DDL for a replicated ClickHouse cluster (``clickhouse.cluster`` set).

The migration files are written for one server: ``CREATE TABLE name (...) ENGINE =
ReplacingMergeTree(...)`` and ``ALTER TABLE name ...``.  On a cluster each table becomes two,
created ``ON CLUSTER`` on every server:

* ``<name>_local``, a ``ReplicatedReplacingMergeTree`` whose replicas share one ZooKeeper path per
  shard (``/clickhouse/tables/{shard}/<database>/<name>_local``, ``{shard}``/``{replica}`` being
  each server's macros): every replica holds every row, and an insert whose blocks were already
  stored (a retried batch) is dropped by the block checksums kept in ZooKeeper;
* ``<name>``, a ``Distributed`` table over the ``_local`` ones, so every named query, the report
  and the sink keep using the names they use on one server.  Rows are sharded by a hash of the
  table's sorting key: a row and its redelivered copy land on the same shard, where
  ``ReplacingMergeTree`` (read with ``FINAL``) collapses them.

An ``ALTER`` changes the ``_local`` table ``ON CLUSTER``; the ``Distributed`` table, which 18.16
refuses to alter ON CLUSTER ("isn't replicated, but shard is replicated according to its cluster
definition"), is dropped and created again with the new columns -- it holds no rows (inserts are
synchronous: ``insert_distributed_sync``).  Any other statement is refused with the reason: a
migration must be written so that both topologies can run it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_CREATE = re.compile(
    r"CREATE TABLE IF NOT EXISTS (?P<name>\w+)\s*(?P<columns>\(.*\))\s*"
    r"ENGINE\s*=\s*(?P<engine>\w*MergeTree)\((?P<args>[^)]*)\)(?P<rest>.*)",
    re.DOTALL | re.IGNORECASE,
)
_ORDER_BY = re.compile(r"ORDER BY\s+", re.IGNORECASE)
_ALTER = re.compile(r"ALTER TABLE (?P<name>\w+)\s+(?P<rest>.*)", re.DOTALL | re.IGNORECASE)

#: the suffix of the replicated table behind each Distributed one.
LOCAL = "_local"


class ClusterDDLError(ValueError):
    """A migration statement that cannot be run on a cluster (the message says why)."""


def local_name(table: str) -> str:
    """The replicated table that holds ``table``'s rows on a cluster."""
    return table + LOCAL


@dataclass
class ClusterDDL:
    """Renders statements for ``cluster``/``database``; remembers each table's sharding key, so
    feed it every migration in order (the applied ones too: an ``ALTER`` needs its table's key)."""

    cluster: str
    database: str
    #: table -> the Distributed table's sharding expression.
    shard_keys: dict[str, str] = field(default_factory=dict)

    def create_database(self) -> str:
        return f"CREATE DATABASE IF NOT EXISTS {self.database} ON CLUSTER {self.cluster}"

    def render(self, statement: str) -> list[str]:
        r"""The statements that do on the cluster what ``statement`` does on one server.

        >>> ddl = ClusterDDL("c", "db")
        >>> local, dist = ddl.render("CREATE TABLE IF NOT EXISTS t (a String, v Int64) "
        ...                          "ENGINE = ReplacingMergeTree(v) ORDER BY (a)")
        >>> print(*local.split(" ENGINE = "), sep="\n")
        CREATE TABLE IF NOT EXISTS db.t_local ON CLUSTER c (a String, v Int64)
        ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/db/t_local', '{replica}', v) ORDER BY (a)
        >>> print(*dist.split(" ENGINE = "), sep="\n")
        CREATE TABLE IF NOT EXISTS db.t ON CLUSTER c AS db.t_local
        Distributed(c, db, t_local, cityHash64(a))
        """
        text = statement.strip().rstrip(";").strip()
        if m := _CREATE.fullmatch(text):
            return self._create(m)
        if m := _ALTER.fullmatch(text):
            return self._alter(m["name"], m["rest"].strip())
        raise ClusterDDLError(
            f"only CREATE TABLE IF NOT EXISTS ... ENGINE = *MergeTree(...) and ALTER TABLE can run on "
            f"cluster {self.cluster!r}; got: {text[:200]}"
        )

    def _create(self, m: re.Match[str]) -> list[str]:
        name, rest = m["name"], " ".join(m["rest"].split())
        self.shard_keys[name] = f"cityHash64({sorting_key(name, rest)})"
        local = local_name(name)
        path = f"'/clickhouse/tables/{{shard}}/{self.database}/{local}', '{{replica}}'"
        args = f"{path}, {m['args'].strip()}" if m["args"].strip() else path
        columns = " ".join(m["columns"].split())
        return [
            f"CREATE TABLE IF NOT EXISTS {self.database}.{local} ON CLUSTER {self.cluster} {columns} "
            f"ENGINE = Replicated{m['engine']}({args}) {rest}",
            self._distributed(name),
        ]

    def _alter(self, name: str, change: str) -> list[str]:
        if name not in self.shard_keys:
            raise ClusterDDLError(f"ALTER TABLE {name}: no earlier migration creates it")
        change = " ".join(change.split())
        return [
            f"ALTER TABLE {self.database}.{local_name(name)} ON CLUSTER {self.cluster} {change}",
            f"DROP TABLE IF EXISTS {self.database}.{name} ON CLUSTER {self.cluster}",
            self._distributed(name),
        ]

    def _distributed(self, name: str) -> str:
        db, local = self.database, local_name(name)
        return (
            f"CREATE TABLE IF NOT EXISTS {db}.{name} ON CLUSTER {self.cluster} AS {db}.{local} "
            f"ENGINE = Distributed({self.cluster}, {db}, {local}, {self.shard_keys[name]})"
        )


def sorting_key(table: str, clause: str) -> str:
    """The expressions of the ``ORDER BY`` in ``clause``, without their parentheses.

    >>> sorting_key("t", "PARTITION BY toDate(ts) ORDER BY (a, if(b < 0, c, 0)) SETTINGS x = 1")
    'a, if(b < 0, c, 0)'
    >>> sorting_key("t", "ORDER BY version")
    'version'
    """
    m = _ORDER_BY.search(clause)
    if m is None:
        raise ClusterDDLError(f"table {table}: no ORDER BY to shard its rows by")
    tail = clause[m.end() :]
    if not tail.startswith("("):
        return tail.split()[0]
    depth = 0
    for i, ch in enumerate(tail):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return tail[1:i].strip()
    raise ClusterDDLError(f"table {table}: unbalanced parentheses in its ORDER BY")
