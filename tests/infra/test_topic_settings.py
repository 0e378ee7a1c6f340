"""Topic settings per deployment (``kafka.replication_factor``, ``min_insync_replicas``, ``topics``) and
the endpoints ``stack.cluster`` points clients at: pure configuration, no broker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from trainguard.infra.config import KafkaConfig, TopicPlan, TopicSettings, load_settings
from trainguard.schemas.config import ConfigError
from trainguard.schemas.topics import EXITS, GPU, LIVENESS, STEPS
from trainguard.streams.context import check_copartitioned
from trainguard.streams.state import changelog_topics


def _load(tmp_path: Path, data: dict, **env: str):  # type: ignore[no-untyped-def,type-arg]
    path = tmp_path / "trainguard.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_settings(path, environ={"TRAINGUARD_HOME": str(tmp_path), **env})


def test_the_embedded_default_is_one_replica_and_the_registry_partitions() -> None:
    assert KafkaConfig().topic_plan(STEPS) == TopicPlan(STEPS.partitions, 1, 1)


def test_production_settings_and_a_per_topic_override(tmp_path: Path) -> None:
    s = _load(
        tmp_path,
        {
            "kafka": {
                "replication_factor": 3,
                "min_insync_replicas": 2,
                "topics": {"trainguard.telemetry.gpu": {"partitions": 32, "replication_factor": 2}},
            }
        },
    )
    assert s.kafka.topic_plan(STEPS) == TopicPlan(8, 3, 2)
    # A topic replicated less than the default keeps a min ISR it can meet.
    assert s.kafka.topic_plan(GPU) == TopicPlan(32, 2, 2)
    assert s.kafka.partitions(GPU) == 32


@pytest.mark.parametrize(
    ("kafka", "error"),
    [
        ({"topics": {"trainguard.nope": {}}}, r"unknown topic\(s\) \['trainguard.nope'\]"),
        ({"topics": {"trainguard.training.steps": {"partitionz": 4}}}, "unknown field.*partitionz"),
        ({"replication_factor": 1, "min_insync_replicas": 2}, "min_insync_replicas 2 > replication_factor 1"),
        (
            {"topics": {"trainguard.training.steps": {"replication_factor": 2, "min_insync_replicas": 3}}},
            "trainguard.training.steps: min_insync_replicas 3 > replication_factor 2",
        ),
        ({"topics": {"trainguard.training.steps": {"partitions": 0}}}, "partitions"),
    ],
)
def test_bad_topic_settings_are_errors_that_say_what(tmp_path: Path, kafka: dict, error: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=error):
        _load(tmp_path, {"kafka": kafka})


def test_a_stage_s_topics_must_keep_equal_partitions() -> None:
    kafka = KafkaConfig(topics={STEPS.name: TopicSettings(partitions=16)})
    with pytest.raises(ValueError, match="training stage's topics must have equal partitions"):
        check_copartitioned(kafka)
    same = {t.name: TopicSettings(partitions=16) for t in (STEPS, EXITS, LIVENESS)}
    check_copartitioned(KafkaConfig(topics=same))
    # The stage's changelog follows its inputs, so a restored key lands on the worker owning it.
    training = [t for t in changelog_topics("w", KafkaConfig(topics=same)) if "training" in t.name]
    assert [t.partitions for t in training] == [16]


def test_the_cluster_stack_s_endpoints_and_replication(tmp_path: Path) -> None:
    s = _load(tmp_path, {}, TRAINGUARD__STACK__CLUSTER="true")
    assert s.kafka.servers == ["127.0.0.1:19192", "127.0.0.1:19193", "127.0.0.1:19194"]
    assert (s.kafka.replication_factor, s.kafka.min_insync_replicas) == (3, 2)
    assert (s.clickhouse.port, s.clickhouse.cluster) == (18223, "trainguard")
    single = _load(tmp_path, {})
    assert (single.kafka.servers, single.clickhouse.cluster) == (["127.0.0.1:19092"], "")


def test_explicit_settings_win_over_the_cluster_stack_s(tmp_path: Path) -> None:
    s = _load(
        tmp_path,
        {"kafka": {"replication_factor": 2, "min_insync_replicas": 1}, "stack": {"cluster_kafka_brokers": 1}},
        TRAINGUARD__STACK__CLUSTER="true",
        TRAINGUARD__CLICKHOUSE__CLUSTER="prod",
    )
    assert (s.kafka.replication_factor, s.kafka.min_insync_replicas, s.clickhouse.cluster) == (2, 1, "prod")
    one = _load(tmp_path, {"stack": {"cluster_kafka_brokers": 1}}, TRAINGUARD__STACK__CLUSTER="true")
    assert (one.kafka.replication_factor, one.kafka.min_insync_replicas) == (1, 1)


def test_a_cluster_on_chdb_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cluster does not apply to a chdb DSN"):
        _load(tmp_path, {"clickhouse": {"dsn": "chdb:///tmp/x", "cluster": "c"}})


def test_stack_status_cluster_lists_every_process_and_fails_when_none_runs(tmp_path: Path) -> None:
    """`--cluster` points the command at the cluster's endpoints; nothing runs in this home, on
    ports nobody listens on: every process is listed down and the exit status says so."""
    from click.testing import CliRunner

    from tests.cluster_fixture import cluster_env
    from trainguard.cli import main

    env = cluster_env(tmp_path)
    del env["TRAINGUARD__STACK__CLUSTER"]  # what the flag sets
    res = CliRunner().invoke(main, ["stack", "status", "--cluster", "--json"], env=env)
    assert res.exit_code == 1, res.output
    st = json.loads(res.output)
    assert len(st["kafka"]["bootstrap_servers"].split(",")) == 3 and not st["healthy"]
    cl = st["cluster"]
    assert [b["name"] for b in cl["kafka"]] == ["kafka-1", "kafka-2", "kafka-3"]
    assert not cl["running"] and not any(p["pid"] for p in cl["kafka"] + cl["clickhouse"])
