"""Connection and stack settings: one config model for the embedded stack and production.

Sources, lowest priority first: defaults (the embedded local stack), a YAML file
(``--config FILE`` or ``$TRAINGUARD_CONFIG``) with sections ``kafka``, ``clickhouse``, ``stack``,
then environment variables ``TRAINGUARD__<SECTION>__<KEY>``, e.g.
``TRAINGUARD__KAFKA__BOOTSTRAP_SERVERS=broker1:9092,broker2:9092``.  ``$TRAINGUARD_HOME`` sets
the data directory of the embedded stack.  Unknown keys anywhere are errors.

Production points ``kafka`` and ``clickhouse`` at real clusters (with TLS/SASL settings) and sets
``stack.embedded: false`` so ``stack up`` refuses to start local servers.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

from schemas.config import ConfigError, load_config, load_yaml_file
from schemas.typecheck import bounds

_PORT = bounds(1, 65535)
T = TypeVar("T")
#: the Python Kafka clients TrainGuard uses (kafka-python; aiokafka, also under Faust).
KafkaClient = Literal["kafka-python", "aiokafka"]


@dataclass(frozen=True)
class KafkaConfig:
    """How every TrainGuard process reaches Kafka."""

    bootstrap_servers: str = "127.0.0.1:19092"
    client_id: str = "trainguard"
    #: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL.
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None  # PLAIN, SCRAM-SHA-256, SCRAM-SHA-512
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    request_timeout_ms: int = field(default=15_000, metadata=bounds(100, 600_000))
    #: producer compression; gzip needs no native library on any client (kafka-python, aiokafka).
    compression: str | None = "gzip"

    def __post_init__(self) -> None:
        allowed = {"PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"}
        if self.security_protocol not in allowed:
            raise ValueError(f"security_protocol must be one of {sorted(allowed)}")

    @property
    def servers(self) -> list[str]:
        return [s.strip() for s in self.bootstrap_servers.split(",") if s.strip()]

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context of ``ssl_cafile``/``ssl_certfile``/``ssl_keyfile`` (None without TLS)."""
        if self.security_protocol not in ("SSL", "SASL_SSL"):
            return None
        ctx = ssl.create_default_context(cafile=self.ssl_cafile)
        if self.ssl_certfile:
            ctx.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
        return ctx

    def client_kwargs(self, client: KafkaClient = "kafka-python") -> dict[str, Any]:
        """Keyword arguments for a Kafka client, the one place TLS/SASL settings are translated.

        Both clients take the same names for servers, timeouts and SASL; TLS differs: kafka-python
        takes the CA/cert/key file paths, aiokafka one ``ssl.SSLContext`` built from them.
        """
        kw: dict[str, Any] = {
            "bootstrap_servers": self.servers,
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
            "request_timeout_ms": self.request_timeout_ms,
        }
        if self.sasl_mechanism:
            kw.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_plain_username=self.sasl_username,
                sasl_plain_password=self.sasl_password,
            )
        if client == "aiokafka":
            if (ctx := self.ssl_context()) is not None:
                kw["ssl_context"] = ctx
        elif client == "kafka-python":
            for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
                if getattr(self, name):
                    kw[name] = getattr(self, name)
        else:
            raise ValueError(f"unknown Kafka client {client!r}")
        return kw


@dataclass(frozen=True)
class ClickHouseConfig:
    """How TrainGuard reaches ClickHouse (HTTP interface, through clickhouse-connect)."""

    host: str = "127.0.0.1"
    port: int = field(default=18123, metadata=_PORT)
    database: str = "trainguard"
    username: str = "default"
    password: str = ""
    secure: bool = False
    connect_timeout_s: float = field(default=5.0, metadata=bounds(0.1, 600))
    #: a clickhouse-connect DSN overriding host/port, e.g. ``chdb:///path`` for in-process tests.
    dsn: str | None = None

    @property
    def url(self) -> str:
        return self.dsn or f"{'https' if self.secure else 'http'}://{self.host}:{self.port}"


@dataclass(frozen=True)
class StackConfig:
    """The embedded local stack started by ``trainguard stack up``."""

    #: False in production: ``stack up`` then refuses to start local servers.
    embedded: bool = True
    home: str = ".trainguard"
    kafka_port: int = field(default=19092, metadata=_PORT)
    kafka_controller_port: int = field(default=19093, metadata=_PORT)
    kafka_heap_mb: int = field(default=512, metadata=bounds(128, 65536))
    clickhouse_http_port: int = field(default=18123, metadata=_PORT)
    clickhouse_tcp_port: int = field(default=19000, metadata=_PORT)
    #: where resolved Kafka jars are cached, shared by every stack home on the machine.
    cache_dir: str = "~/.cache/trainguard"
    start_timeout_s: float = field(default=90.0, metadata=bounds(1, 3600))

    @property
    def home_path(self) -> Path:
        return Path(self.home).expanduser().resolve()

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser().resolve()


#: YAML sections owned by one component each (worker, exporter, action service); each component
#: validates its own section with its own config dataclass (:func:`component_config`).
COMPONENT_SECTIONS = ("worker", "exporter", "actions")


@dataclass(frozen=True)
class Settings:
    """Everything a TrainGuard process needs to reach the stack."""

    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    clickhouse: ClickHouseConfig = field(default_factory=ClickHouseConfig)
    stack: StackConfig = field(default_factory=StackConfig)
    #: raw component sections of the YAML file, validated by :func:`component_config`.
    components: dict[str, Any] = field(default_factory=dict)
    #: the environment the settings were loaded from (component env overrides come from it).
    environ: dict[str, str] = field(default_factory=dict, repr=False, compare=False)


def component_config(settings: Settings, section: str, cls: type[T]) -> T:
    """Build one component's config dataclass from its YAML section + ``TRAINGUARD__<SECTION>__*``."""
    if section not in COMPONENT_SECTIONS:
        raise ConfigError(f"unknown component section {section!r}")
    data = settings.components.get(section) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{section}: expected a mapping")
    return load_config(cls, data, env_prefix=f"TRAINGUARD__{section.upper()}", environ=settings.environ)


def load_settings(
    path: str | os.PathLike[str] | None = None, environ: dict[str, str] | None = None
) -> Settings:
    """Defaults <- YAML file <- ``TRAINGUARD__*`` env vars; ``$TRAINGUARD_HOME`` sets stack.home."""
    env = dict(os.environ if environ is None else environ)
    path = path or env.get("TRAINGUARD_CONFIG")
    data: dict[str, Any] = load_yaml_file(path) if path else {}
    home = env.get("TRAINGUARD_HOME")
    if home:
        data.setdefault("stack", {})
        if not isinstance(data["stack"], dict):
            raise ConfigError("stack: expected a mapping")
        data["stack"].setdefault("home", home)
    components = {k: data.pop(k) for k in COMPONENT_SECTIONS if k in data}
    core_env = {
        k: v
        for k, v in env.items()
        if not any(k.upper().startswith(f"TRAINGUARD__{c.upper()}__") for c in COMPONENT_SECTIONS)
    }
    settings = load_config(Settings, data, env_prefix="TRAINGUARD", environ=core_env)
    settings = replace(settings, components=components, environ=env)
    return _derive_embedded_endpoints(settings, data, env)


def _derive_embedded_endpoints(settings: Settings, data: dict[str, Any], env: dict[str, str]) -> Settings:
    """With the embedded stack on custom ports, point clients at them unless set explicitly."""
    if not settings.stack.embedded:
        return settings
    kafka, ch = settings.kafka, settings.clickhouse
    kafka_set = "bootstrap_servers" in data.get("kafka", {}) or "TRAINGUARD__KAFKA__BOOTSTRAP_SERVERS" in env
    ch_set = "port" in data.get("clickhouse", {}) or "TRAINGUARD__CLICKHOUSE__PORT" in env
    if not kafka_set:
        kafka = replace(kafka, bootstrap_servers=f"127.0.0.1:{settings.stack.kafka_port}")
    if not ch_set and not ch.dsn:
        ch = replace(ch, host="127.0.0.1", port=settings.stack.clickhouse_http_port)
    return replace(settings, kafka=kafka, clickhouse=ch)
