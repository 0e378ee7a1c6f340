"""The migrations rendered for a replicated cluster, and the cluster stack's server configs: pure text."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainguard.infra.clickhouse.cluster_ddl import ClusterDDL, ClusterDDLError
from trainguard.infra.clickhouse.store import load_migrations
from trainguard.infra.config import StackConfig
from trainguard.infra.stack.clickhouse import cluster_replicas
from trainguard.infra.stack.kafka import cluster_nodes, server_properties, single_node
from trainguard.infra.stack.zookeeper import zoo_cfg


def _render_all() -> tuple[ClusterDDL, list[str]]:
    ddl = ClusterDDL("tgc", "tg")
    out = [s for m in load_migrations() for stmt in m.statements() for s in ddl.render(stmt)]
    return ddl, out


def test_every_table_of_the_migrations_becomes_replicated_behind_a_distributed_one() -> None:
    ddl, statements = _render_all()
    created = re.findall(
        r"CREATE TABLE IF NOT EXISTS tg\.(\w+) ON CLUSTER tgc (?:\(|AS )", "\n".join(statements)
    )
    tables = sorted(ddl.shard_keys)
    assert "training_steps" in tables and "decisions" in tables
    assert {t for t in created if not t.endswith("_local")} == set(tables)
    assert {t for t in created if t.endswith("_local")} == {f"{t}_local" for t in tables}
    for s in statements:
        assert " ON CLUSTER tgc" in s, s
        if (
            "_local ON CLUSTER tgc (" in s
        ):  # the replicated table: its own ZooKeeper path, each replica's macro
            name = s.split("tg.", 1)[1].split(" ", 1)[0]
            assert (
                f"ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{{shard}}/tg/{name}', '{{replica}}'"
                in s
            )


def test_rows_are_sharded_by_their_whole_sorting_key() -> None:
    """A redelivered row lands on the shard of its first copy, where FINAL collapses the two."""
    ddl, _ = _render_all()
    assert ddl.shard_keys["training_steps"] == "cityHash64(job, rank, step, ts_ms)"
    assert (
        ddl.shard_keys["dead_letters"]
        == "cityHash64(topic, partition, offset, stage, if(offset < 0, ts_ms, 0))"
    )
    assert ddl.shard_keys["commands"] == "cityHash64(command_id)"


def test_an_alter_changes_the_replicated_table_and_rebuilds_the_distributed_one() -> None:
    ddl = ClusterDDL("c", "db")
    ddl.render("CREATE TABLE IF NOT EXISTS t (a String) ENGINE = ReplacingMergeTree() ORDER BY a")
    assert ddl.render("ALTER TABLE t\n    ADD COLUMN b UInt8,\n    ADD COLUMN c UInt8;") == [
        "ALTER TABLE db.t_local ON CLUSTER c ADD COLUMN b UInt8, ADD COLUMN c UInt8",
        "DROP TABLE IF EXISTS db.t ON CLUSTER c",
        "CREATE TABLE IF NOT EXISTS db.t ON CLUSTER c AS db.t_local ENGINE = Distributed(c, db, t_local, cityHash64(a))",
    ]


@pytest.mark.parametrize(
    ("statement", "error"),
    [
        ("INSERT INTO t VALUES (1)", "only CREATE TABLE IF NOT EXISTS"),
        ("CREATE TABLE t (a String) ENGINE = Log", "only CREATE TABLE IF NOT EXISTS"),
        ("ALTER TABLE never_created ADD COLUMN b UInt8", "no earlier migration creates it"),
        ("CREATE TABLE IF NOT EXISTS t (a String) ENGINE = MergeTree() PARTITION BY a", "no ORDER BY"),
    ],
)
def test_statements_a_cluster_cannot_run_are_refused_with_the_reason(statement: str, error: str) -> None:
    with pytest.raises(ClusterDDLError, match=error):
        ClusterDDL("c", "db").render(statement)


def test_the_cluster_brokers_form_one_quorum_on_ports_of_their_own(tmp_path: Path) -> None:
    cfg = StackConfig(home=str(tmp_path))
    nodes = cluster_nodes(cfg)
    assert [(n.node_id, n.port, n.controller_port) for n in nodes] == [
        (1, 19192, 19292),
        (2, 19193, 19293),
        (3, 19194, 19294),
    ]
    props = server_properties(nodes[1], tmp_path)
    assert "controller.quorum.voters=1@127.0.0.1:19292,2@127.0.0.1:19293,3@127.0.0.1:19294\n" in props
    assert "node.id=2\n" in props and "offsets.topic.replication.factor=3\n" in props
    assert "transaction.state.log.min.isr=2\n" in props
    assert len({n.cluster_id_file for n in nodes}) == 1  # one cluster id for all three
    lone = server_properties(single_node(cfg), tmp_path)
    assert (
        "controller.quorum.voters=1@127.0.0.1:19093\n" in lone
        and "offsets.topic.replication.factor=1\n" in lone
    )


def test_each_replica_knows_zookeeper_every_replica_and_its_own_macros(tmp_path: Path) -> None:
    cfg = StackConfig(home=str(tmp_path), zookeeper_port=12999)
    r1, r2 = cluster_replicas(cfg)
    assert (r1.http_port, r1.tcp_port, r1.interserver_port) == (18223, 19100, 19110)
    assert (r2.http_port, r2.tcp_port, r2.interserver_port) == (18224, 19101, 19111)
    for i, r in enumerate((r1, r2), start=1):
        assert "<port>12999</port>" in r.cluster_xml
        assert "<port>19100</port>" in r.cluster_xml and "<port>19101</port>" in r.cluster_xml
        assert f"<replica>r{i}</replica>" in r.cluster_xml
        assert "<internal_replication>true</internal_replication>" in r.cluster_xml


def test_zookeeper_listens_on_localhost_without_its_admin_server(tmp_path: Path) -> None:
    text = zoo_cfg(12999, tmp_path)
    assert "clientPort=12999\n" in text and "clientPortAddress=127.0.0.1\n" in text
    assert "admin.enableServer=false\n" in text
