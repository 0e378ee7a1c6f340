"""A Kafka broker of a test's own, on free ports: a test may stop and restart it (an outage)
without disturbing the shared stack or any other test."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.net import free_ports
from trainguard.infra.bus import create_topics
from trainguard.infra.config import Settings, load_settings
from trainguard.infra.signing import init_keys
from trainguard.infra.stack.kafka import KafkaServer
from trainguard.schemas.topics import Topic


@contextmanager
def private_kafka(home: Path, topics: Iterable[Topic]) -> Iterator[tuple[Settings, KafkaServer]]:
    """Start a broker whose data lives under ``home`` with ``topics`` created; stop it after."""
    kafka_port, controller_port = free_ports(2)
    env = {
        "TRAINGUARD_HOME": str(home),
        "TRAINGUARD__STACK__KAFKA_PORT": str(kafka_port),
        "TRAINGUARD__STACK__KAFKA_CONTROLLER_PORT": str(controller_port),
    }
    settings = load_settings(environ=env)
    init_keys(home / "keys")  # what `stack up` does: the private home signs and verifies on its own
    server = KafkaServer(settings.stack)
    server.start()
    try:
        server.wait_healthy(90)
        create_topics(settings.kafka, list(topics))
        yield settings, server
    finally:
        server.stop()
