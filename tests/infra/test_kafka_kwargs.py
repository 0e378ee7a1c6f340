"""One builder of Kafka client keyword arguments for kafka-python and aiokafka/Faust."""

from __future__ import annotations

import inspect
import ssl
from typing import Any

import certifi
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from kafka import KafkaConsumer, KafkaProducer

from trainguard.infra.config import KafkaConfig
from trainguard.streams.kafka_compat import aiokafka_kwargs, faust_broker

SASL_SSL = KafkaConfig(
    bootstrap_servers="k1:9093, k2:9093",
    security_protocol="SASL_SSL",
    sasl_mechanism="SCRAM-SHA-512",
    sasl_username="tg",
    sasl_password="secret",
    ssl_cafile=certifi.where(),
)


def _accepted(cls: Any) -> set[str]:
    return set(inspect.signature(cls).parameters)


def test_both_clients_get_the_same_settings_under_their_own_names() -> None:
    kp, aio = SASL_SSL.client_kwargs(), SASL_SSL.client_kwargs("aiokafka")
    assert aiokafka_kwargs(SASL_SSL).keys() == aio.keys()
    common = {k: v for k, v in kp.items() if not k.startswith("ssl_")}
    assert common == {k: v for k, v in aio.items() if k != "ssl_context"}
    assert common["bootstrap_servers"] == ["k1:9093", "k2:9093"]
    assert common["sasl_plain_username"] == "tg" and common["sasl_plain_password"] == "secret"
    assert kp["ssl_cafile"] == certifi.where() and "ssl_context" not in kp
    assert isinstance(aio["ssl_context"], ssl.SSLContext) and "ssl_cafile" not in aio
    # Every name is one the client takes (a wrong name is a TypeError only at connect time).
    for cls in (KafkaConsumer, KafkaProducer):
        assert set(kp) <= set(cls.DEFAULT_CONFIG), cls
    for cls in (AIOKafkaConsumer, AIOKafkaProducer):
        assert set(aio) <= _accepted(cls), cls


def test_plaintext_has_no_tls_or_sasl_settings() -> None:
    cfg = KafkaConfig()
    assert cfg.ssl_context() is None
    for client in ("kafka-python", "aiokafka"):
        kw = cfg.client_kwargs(client)  # type: ignore[arg-type]
        assert not any(k.startswith(("ssl", "sasl")) for k in kw)
    with pytest.raises(ValueError, match="unknown Kafka client"):
        cfg.client_kwargs("confluent")  # type: ignore[arg-type]


def test_faust_credentials_carry_the_same_tls_context() -> None:
    url, creds = faust_broker(SASL_SSL)
    assert url == "kafka://k1:9093;kafka://k2:9093"
    assert creds.username == "tg" and creds.mechanism.value == "SCRAM-SHA-512"
    assert isinstance(creds.ssl_context, ssl.SSLContext)
    assert faust_broker(KafkaConfig()) == ("kafka://127.0.0.1:19092", None)
