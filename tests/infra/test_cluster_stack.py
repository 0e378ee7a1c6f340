"""``stack up --cluster`` on real processes: 3 KRaft brokers, 2 ClickHouse replicas, ZooKeeper.

Topics replicated 3 ways with ``min.insync.replicas`` 2 keep every acknowledged event through the
loss of a partition's leader; a replicated table holds a retried batch once, on both replicas;
bad settings (more replicas than brokers, a cluster name the servers do not know) fail with what
to change; ``down`` stops every process of the cluster.
"""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest

from tests.cluster_fixture import cluster_settings as cluster_settings  # the module's private cluster
from tests.waiting import wait_until
from trainguard.infra.bus import BusError, EventConsumer, EventProducer, create_topics
from trainguard.infra.clickhouse.store import ClickHouseStore, StoreError
from trainguard.infra.config import Settings
from trainguard.infra.stack.cluster import LocalCluster
from trainguard.infra.stack.manager import Stack
from trainguard.schemas.base import now_ms
from trainguard.schemas.topics import STEPS
from trainguard.schemas.workload import TrainingStep

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _steps(job: str, n: int, first: int = 0) -> list[TrainingStep]:
    t0 = now_ms()
    return [TrainingStep(job=job, rank=0, step=first + i, ts_ms=t0 + i, step_time_s=1.0) for i in range(n)]


def test_status_shows_every_process_healthy(cluster_settings: Settings) -> None:
    st = Stack(cluster_settings).status()
    assert st["healthy"], st
    cl = st["cluster"]
    assert [b["name"] for b in cl["kafka"]] == ["kafka-1", "kafka-2", "kafka-3"]
    assert [r["name"] for r in cl["clickhouse"]] == ["clickhouse-1", "clickhouse-2"]
    assert cl["zookeeper"]["healthy"] and all(p["pid"] for p in cl["kafka"] + cl["clickhouse"])
    assert len(cluster_settings.kafka.servers) == 3


def test_topics_are_replicated_three_ways_with_min_isr_two(cluster_settings: Settings) -> None:
    from kafka import KafkaAdminClient
    from kafka.admin import ConfigResource, ConfigResourceType

    admin = KafkaAdminClient(**cluster_settings.kafka.client_kwargs())
    try:
        (desc,) = admin.describe_topics([STEPS.name])
        assert len(desc["partitions"]) == STEPS.partitions
        assert {len(p["replica_nodes"]) for p in desc["partitions"]} == {3}
        # The controller quorum spread the leaders over the brokers.
        assert len({p["leader_id"] for p in desc["partitions"]}) == 3
        res = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, STEPS.name)])
        assert res["topic"][STEPS.name]["min.insync.replicas"]["value"] == "2"
    finally:
        admin.close()


def test_more_replicas_than_brokers_is_a_clear_error(cluster_settings: Settings) -> None:
    kafka = replace(cluster_settings.kafka, replication_factor=5, min_insync_replicas=2)
    with pytest.raises(BusError, match=r"replication factor 5 needs as many live brokers.* has 3"):
        create_topics(kafka, [replace(STEPS, name=f"trainguard.rf5-{uuid.uuid4().hex[:6]}")])


def test_acknowledged_events_survive_the_loss_of_a_leader(cluster_settings: Settings) -> None:
    """Half the steps go in, the leader of their partition is stopped, the other half go in: a new
    consumer group reads every one (acks=all with 2 in-sync replicas lost none), then the broker
    comes back."""
    job = f"j-{uuid.uuid4().hex[:8]}"
    producer = EventProducer(cluster_settings.kafka, linger_ms=0)
    for ev in _steps(job, 50):
        producer.send(ev).get(timeout=30)
    cluster = LocalCluster(cluster_settings.stack)
    leader = _leader_of(cluster_settings, job)
    broker = next(b for b in cluster.brokers if b.node.node_id == leader)
    assert broker.stop()
    try:
        for ev in _steps(job, 50, first=50):
            producer.send(ev).get(timeout=60)  # waits out the leader election
        producer.close()
        consumer = EventConsumer(cluster_settings.kafka, [STEPS.name], group_id=f"g-{uuid.uuid4().hex[:6]}")
        seen: set[int] = set()

        def all_read() -> bool:
            seen.update(e.step for e in consumer.poll(500).events if getattr(e, "job", "") == job)
            return len(seen) == 100

        wait_until(all_read, 90, lambda: f"all 100 steps of {job} (read {len(seen)})")
        consumer.close()
    finally:
        broker.start()
        broker.wait_healthy(90)


def _leader_of(settings: Settings, job: str) -> int:
    """The broker leading the steps partition that ``job``'s key hashes to."""
    from kafka import KafkaAdminClient, KafkaProducer

    producer = KafkaProducer(**settings.kafka.client_kwargs())
    partition = producer.send(STEPS.name, key=job.encode(), value=b"").get(timeout=30).partition
    producer.close()
    admin = KafkaAdminClient(**settings.kafka.client_kwargs())
    try:
        (desc,) = admin.describe_topics([STEPS.name])
    finally:
        admin.close()
    return int(next(p["leader_id"] for p in desc["partitions"] if p["partition_index"] == partition))


def test_a_retried_batch_is_stored_once_on_both_replicas(cluster_settings: Settings) -> None:
    """The same rows inserted twice (a retry after an insert that had gone in), the second time
    through the other replica: ZooKeeper's block checksums keep one copy, before any merge."""
    job = f"j-{uuid.uuid4().hex[:8]}"
    batch = _steps(job, 20)
    first = ClickHouseStore(cluster_settings.clickhouse)
    second_port = cluster_settings.stack.cluster_clickhouse_http_port + 1
    second = ClickHouseStore(replace(cluster_settings.clickhouse, port=second_port))
    try:
        first.insert_events(batch)
        second.insert_events(batch)
        where, params = "job = %(job)s", {"job": job}
        raw = f"SELECT count() FROM training_steps WHERE {where}"  # no FINAL: no merge needed
        assert first.query(raw, params)[0][0] == 20
        for store in (first, second):
            wait_until(
                lambda s=store: (
                    s.query(f"SELECT count() FROM training_steps_local WHERE {where}", params)[0][0] == 20
                ),
                30,
                "the rows replicated to both replicas",
            )
    finally:
        first.close()
        second.close()


def test_a_cluster_the_servers_do_not_know_is_a_clear_error(cluster_settings: Settings) -> None:
    cfg = replace(cluster_settings.clickhouse, cluster="nowhere", database=f"tg_{uuid.uuid4().hex[:8]}")
    store = ClickHouseStore(cfg)
    with pytest.raises(StoreError, match="'nowhere' is no cluster of the server's remote_servers"):
        store.migrate()


def test_down_stops_every_process_of_the_cluster(cluster_settings: Settings) -> None:
    # Last in the module: the fixture's own `down` then finds nothing left to stop.
    stopped = Stack(cluster_settings).down()
    assert sorted(stopped) == sorted(
        ["kafka-1", "kafka-2", "kafka-3", "clickhouse-1", "clickhouse-2", "zookeeper"]
    )
    assert not LocalCluster(cluster_settings.stack).running()
