"""Connection and stack settings: one config model for the embedded stack and production.

Sources, lowest priority first: defaults (the embedded local stack), a YAML file
(``--config FILE`` or ``$TRAINGUARD_CONFIG``) with sections ``kafka``, ``clickhouse``, ``stack``,
then environment variables ``TRAINGUARD__<SECTION>__<KEY>``, e.g.
``TRAINGUARD__KAFKA__BOOTSTRAP_SERVERS=broker1:9092,broker2:9092``.  ``$TRAINGUARD_HOME`` sets
the stack home (the embedded stack's data, the signing keys, the action service's and the
worker's state); without it (or ``stack.home``) the home is :func:`default_home`, the same from
every working directory.  Unknown keys anywhere are errors.

Production points ``kafka`` and ``clickhouse`` at real clusters (with TLS/SASL settings) and sets
``stack.embedded: false`` so ``stack up`` refuses to start local servers.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

from trainguard.infra.signing import SigningConfig
from trainguard.schemas.config import ConfigError, load_config, load_yaml_file
from trainguard.schemas.topics import BY_NAME, Topic
from trainguard.schemas.typecheck import bounds

_PORT = bounds(1, 65535)
T = TypeVar("T")
#: the Python Kafka clients TrainGuard uses (kafka-python; aiokafka, also under Faust).
KafkaClient = Literal["kafka-python", "aiokafka"]
#: ClickHouseConfig's TLS file options (each must exist when a client is created).
_CH_TLS_FILES = ("ca_file", "cert_file", "key_file")
#: the ClickHouse cluster name (``remote_servers``) of the local cluster stack (``stack up --cluster``).
LOCAL_CLUSTER = "trainguard"


@dataclass(frozen=True)
class TopicSettings:
    """One topic's deployment settings (``kafka.topics.<name>``); unset fields take the defaults
    of :class:`KafkaConfig` (replication) or the registry (partitions)."""

    #: more partitions spread a topic over more workers; co-partitioned topics must stay equal.
    partitions: int | None = field(default=None, metadata=bounds(1, 10_000))
    replication_factor: int | None = field(default=None, metadata=bounds(1, 32))
    #: replicas that must have a write before ``acks=all`` returns (Kafka's ``min.insync.replicas``).
    min_insync_replicas: int | None = field(default=None, metadata=bounds(1, 32))


@dataclass(frozen=True)
class TopicPlan:
    """What a topic is created with: partitions, replication factor, min in-sync replicas."""

    partitions: int
    replication_factor: int
    min_insync_replicas: int


@dataclass(frozen=True)
class KafkaConfig:
    """How every TrainGuard process reaches Kafka."""

    bootstrap_servers: str = "127.0.0.1:19092"
    client_id: str = "trainguard"
    #: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL.
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None  # PLAIN, SCRAM-SHA-256, SCRAM-SHA-512
    sasl_username: str | None = None
    #: never in a repr (configs get logged and printed in tracebacks).
    sasl_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    request_timeout_ms: int = field(default=15_000, metadata=bounds(100, 600_000))
    #: producer compression; gzip needs no native library on any client (kafka-python, aiokafka).
    compression: str | None = "gzip"
    #: every topic's replication factor and ``min.insync.replicas`` unless ``topics`` says
    #: otherwise: 1/1 for the one-broker embedded stack; production wants 3/2 (a broker may be lost
    #: without losing an acknowledged write or refusing new ones).
    replication_factor: int = field(default=1, metadata=bounds(1, 32))
    min_insync_replicas: int = field(default=1, metadata=bounds(1, 32))
    #: per topic (registry name, e.g. ``trainguard.training.steps``): partitions and replication.
    topics: dict[str, TopicSettings] = field(default_factory=dict)

    def __post_init__(self) -> None:
        allowed = {"PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"}
        if self.security_protocol not in allowed:
            raise ValueError(f"security_protocol must be one of {sorted(allowed)}")
        if self.min_insync_replicas > self.replication_factor:
            raise ValueError(
                f"min_insync_replicas {self.min_insync_replicas} > replication_factor "
                f"{self.replication_factor} (no write could ever be acknowledged)"
            )
        unknown = sorted(set(self.topics) - set(BY_NAME))
        if unknown:
            raise ValueError(f"topics: unknown topic(s) {unknown}; the registry's are {sorted(BY_NAME)}")
        for t in BY_NAME.values():
            self.topic_plan(t)  # min.insync.replicas above the replication factor: an error now

    def topic_plan(self, topic: Topic) -> TopicPlan:
        """``topic``'s partitions and replication in this deployment.  A topic outside the registry
        (a worker's changelog, a namespaced twin named by its base topic) takes the defaults."""
        own = self.topics.get(topic.name, TopicSettings())
        rf = own.replication_factor or self.replication_factor
        isr = own.min_insync_replicas or min(self.min_insync_replicas, rf)
        if isr > rf:
            raise ValueError(
                f"topic {topic.name}: min_insync_replicas {isr} > replication_factor {rf} "
                "(no write could ever be acknowledged)"
            )
        return TopicPlan(own.partitions or topic.partitions, rf, isr)

    def partitions(self, topic: Topic) -> int:
        """``topic``'s partition count in this deployment (the registry's unless configured)."""
        return self.topic_plan(topic).partitions

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
    password: str = field(default="", repr=False)
    #: HTTPS instead of HTTP; the TLS options below need it (set without it they are an error).
    secure: bool = False
    #: PEM bundle of the CA(s) that signed the server certificate; unset: the system trust store;
    #: ``certifi``: the public roots of the certifi package.
    ca_file: str | None = None
    #: client certificate and its private key (PEM), for servers that require mutual TLS; set both
    #: or neither.  They prove the connection, not the user: username/password are still sent.
    cert_file: str | None = None
    key_file: str | None = None
    #: check the server certificate (CA and host name); false only for a throwaway test server.
    verify: bool = True
    connect_timeout_s: float = field(default=5.0, metadata=bounds(0.1, 600))
    #: a clickhouse-connect DSN overriding host/port, e.g. ``chdb:///path`` for in-process tests.
    dsn: str | None = None
    #: the ClickHouse cluster (a ``remote_servers`` name) the tables are replicated over: migrations
    #: run ``ON CLUSTER`` with ``Replicated*`` tables behind ``Distributed`` ones of the queried
    #: names (:mod:`trainguard.infra.clickhouse.cluster_ddl`); empty: one server, plain tables.
    cluster: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            given, missing = ("cert_file", "key_file") if self.cert_file else ("key_file", "cert_file")
            raise ValueError(
                f"{given} is set but {missing} is not: a client certificate needs its private key "
                "(set both cert_file and key_file, or neither)"
            )
        tls = [name for name in _CH_TLS_FILES if getattr(self, name)]
        if not self.verify:
            tls.append("verify=false")
        if tls and not self.secure:
            raise ValueError(
                f"TLS option(s) {', '.join(tls)} set without secure: true; they apply to HTTPS only "
                "(set secure: true, or remove them)"
            )
        if self.secure and self.dsn and self.dsn.startswith("chdb"):
            raise ValueError("secure/TLS options do not apply to a chdb DSN (in-process ClickHouse)")
        if self.cluster and self.dsn and self.dsn.startswith("chdb"):
            raise ValueError("cluster does not apply to a chdb DSN (in-process ClickHouse has no replicas)")

    @property
    def url(self) -> str:
        return self.dsn or f"{'https' if self.secure else 'http'}://{self.host}:{self.port}"

    def client_kwargs(self, database: str | None = None) -> dict[str, Any]:
        """Keyword arguments for ``clickhouse_connect.get_client``, the one place connection and
        TLS settings are translated.

        ``database`` overrides :attr:`database` (``""``: the user's default one, e.g. to create
        ours).  A TLS file that is not there is a :class:`ConfigError` naming its field, raised
        here, i.e. when the client is created, not when the settings are loaded.  A client
        certificate secures the connection only (``tls_mode="strict"``): the user is still the
        configured username/password, not the certificate's subject.
        """
        db = self.database if database is None else database
        kw: dict[str, Any]
        if self.dsn:
            kw = {"dsn": self.dsn, "database": db}
        else:
            kw = {
                "host": self.host,
                "port": self.port,
                "username": self.username,
                "password": self.password,
                "secure": self.secure,  # explicit: else clickhouse-connect guesses from the port
                "database": db,
                "connect_timeout": self.connect_timeout_s,
                "compress": "gzip",
            }
            if self.cluster:
                # An insert returns once a replica stored it (not queued on the server it went to),
                # and a retried batch meets the block checksums of its first try there.  A subquery
                # over a Distributed table inside a distributed query is sent to the shards as a
                # temporary table (18.16 refuses such a query by default, "Double-distributed").
                kw["settings"] = {"insert_distributed_sync": 1, "distributed_product_mode": "global"}
        if not self.secure:
            return kw
        files = {name: self._tls_file(name) for name in _CH_TLS_FILES if getattr(self, name)}
        kw.update(secure=True, verify=self.verify)
        if self.verify and "ca_file" in files:
            kw["ca_cert"] = files["ca_file"]
        if "cert_file" in files:
            kw.update(client_cert=files["cert_file"], client_cert_key=files["key_file"], tls_mode="strict")
        return kw

    def _tls_file(self, name: str) -> str:
        value = str(getattr(self, name))
        if name == "ca_file" and value == "certifi":
            return value
        path = Path(value).expanduser()
        if not path.is_file():
            why = "is not a file" if path.exists() else "does not exist"
            raise ConfigError(f"clickhouse.{name}: {path} {why}")
        if not os.access(path, os.R_OK):
            raise ConfigError(f"clickhouse.{name}: {path} is not readable")
        return str(path)


@dataclass(frozen=True)
class StackConfig:
    """The embedded local stack started by ``trainguard stack up``."""

    #: False in production: ``stack up`` then refuses to start local servers.
    embedded: bool = True
    #: the stack home; empty: :func:`default_home` (``$TRAINGUARD_HOME`` sets it too).
    home: str = ""
    kafka_port: int = field(default=19092, metadata=_PORT)
    kafka_controller_port: int = field(default=19093, metadata=_PORT)
    kafka_heap_mb: int = field(default=512, metadata=bounds(128, 65536))
    clickhouse_http_port: int = field(default=18123, metadata=_PORT)
    clickhouse_tcp_port: int = field(default=19000, metadata=_PORT)
    #: where resolved Kafka jars are cached, shared by every stack home on the machine.
    cache_dir: str = "~/.cache/trainguard"
    start_timeout_s: float = field(default=90.0, metadata=bounds(1, 3600))
    #: the private Slurm cluster of ``stack up --slurm`` (nodes n1..nN, one slurmd each).
    slurm_nodes: int = field(default=6, metadata=bounds(1, 64))
    slurm_cpus_per_node: int = field(default=2, metadata=bounds(1, 1024))
    slurm_ctld_port: int = field(default=16817, metadata=_PORT)
    #: node nX's slurmd listens on ``slurm_first_node_port + X - 1``.
    slurm_first_node_port: int = field(default=17001, metadata=_PORT)
    #: a Slurm Prolog for the private cluster (``Prolog=``: an absolute path, e.g. TrainGuard's
    #: preflight ``infra/deploy/prolog.sh``); empty: no prolog.  Set, the conf also gets
    #: ``PrologFlags=Alloc,DeferBatch`` (every node of a job runs it at allocation, the batch script
    #: starts when all passed) and, unless ``slurm_prolog_hold``, ``SchedulerParameters=
    #: nohold_on_prolog_fail`` (a job whose prolog failed is requeued to start on other nodes).
    slurm_prolog: str = ""
    #: with ``slurm_prolog``: a job whose prolog failed is requeued held (it waits for an operator's
    #: ``scontrol release``), Slurm's default, instead of starting on other nodes.
    slurm_prolog_hold: bool = False
    #: the private Kubernetes control plane of ``stack up --k8s`` (nodes n1..nN, kwok-managed).
    k8s_nodes: int = field(default=12, metadata=bounds(1, 500))
    k8s_etcd_port: int = field(default=12379, metadata=_PORT)
    k8s_apiserver_port: int = field(default=16443, metadata=_PORT)
    #: where the built control-plane binaries are; empty: ``<cache_dir>/k8s-<version>/bin``.
    k8s_bin_dir: str = ""
    #: clients use the local cluster of ``stack up --cluster`` (below) instead of the one-node stack.
    cluster: bool = False
    #: its Kafka brokers, each broker and KRaft controller (a voter) at once: broker i (from 1)
    #: listens on ``cluster_kafka_port + i - 1``, its controller on ``cluster_kafka_controller_port + i - 1``.
    cluster_kafka_brokers: int = field(default=3, metadata=bounds(1, 9))
    cluster_kafka_port: int = field(default=19192, metadata=_PORT)
    cluster_kafka_controller_port: int = field(default=19292, metadata=_PORT)
    #: small: three brokers share the machine with everything else.
    cluster_kafka_heap_mb: int = field(default=384, metadata=bounds(128, 65536))
    #: its ClickHouse replicas (one shard), replica i on ``<port> + i - 1`` of each port below.
    cluster_clickhouse_replicas: int = field(default=2, metadata=bounds(1, 9))
    cluster_clickhouse_http_port: int = field(default=18223, metadata=_PORT)
    cluster_clickhouse_tcp_port: int = field(default=19100, metadata=_PORT)
    #: where replicas fetch parts from each other.
    cluster_clickhouse_interserver_port: int = field(default=19110, metadata=_PORT)
    #: the ZooKeeper that coordinates the replicas (ClickHouse 18.16 has no Keeper).
    zookeeper_port: int = field(default=12181, metadata=_PORT)
    zookeeper_heap_mb: int = field(default=128, metadata=bounds(64, 65536))

    def cluster_ports(self, base: int, count: int) -> list[int]:
        """``count`` consecutive ports from ``base`` (one per broker or replica)."""
        return [base + i for i in range(count)]

    @property
    def cluster_bootstrap(self) -> str:
        ports = self.cluster_ports(self.cluster_kafka_port, self.cluster_kafka_brokers)
        return ",".join(f"127.0.0.1:{p}" for p in ports)

    @property
    def home_path(self) -> Path:
        return Path(self.home or default_home()).expanduser().resolve()

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser().resolve()


def default_home(environ: Mapping[str, str] | None = None) -> Path:
    """The stack home when neither ``$TRAINGUARD_HOME`` nor ``stack.home`` names one:
    ``$XDG_DATA_HOME/trainguard``, else ``~/.local/share/trainguard`` -- the same from every
    working directory (a home relative to the current one found no keys and no state from
    anywhere else).

    >>> str(default_home({"HOME": "/home/ada"}))
    '/home/ada/.local/share/trainguard'
    >>> str(default_home({"HOME": "/home/ada", "XDG_DATA_HOME": "/data/ada"}))
    '/data/ada/trainguard'
    """
    # One per-user rule, root included (not /var/lib/trainguard for root): the CLI runs as root
    # in containers and CI as often as in a service, and a service names its state directory
    # anyway (the deployments mount a volume there and set stack.home or --state-dir), so a
    # root-only default would mostly move a developer's stack somewhere else without a word.
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_DATA_HOME", "")
    if os.path.isabs(xdg):  # the XDG spec: a relative value is invalid and ignored
        return Path(xdg) / "trainguard"
    user_home = env.get("HOME", "")
    if not os.path.isabs(user_home):
        try:
            user_home = str(Path.home())
        except RuntimeError:
            raise ConfigError(
                "no home directory (HOME is unset) to put the stack home in: set TRAINGUARD_HOME"
            ) from None
    return Path(user_home) / ".local" / "share" / "trainguard"


def home_origin(settings: Settings) -> str:
    """What chose the stack home of ``settings``, in words (for messages and ``stack status``)."""
    home, env = settings.stack.home_path, settings.environ
    if env.get("TRAINGUARD__STACK__HOME"):
        return "set by $TRAINGUARD__STACK__HOME"
    if env.get("TRAINGUARD_HOME") and Path(env["TRAINGUARD_HOME"]).expanduser().resolve() == home:
        return "set by $TRAINGUARD_HOME"
    if home == default_home(env).resolve():
        return "the default; $TRAINGUARD_HOME sets another"
    return "set by stack.home in the config file"


def home_note(settings: Settings) -> str:
    """Which stack home a command used and what chose it: ``stack home /x (the default; ...)``."""
    return f"stack home {settings.stack.home_path} ({home_origin(settings)})"


def with_home_note(settings: Settings, message: str) -> str:
    """``message``, followed by :func:`home_note` when it names a path in the stack home."""
    if str(settings.stack.home_path) not in message:
        return message
    return f"{message}\n  {home_note(settings)}"


#: YAML sections owned by one component each (worker, exporter, action service); each component
#: validates its own section with its own config dataclass (:func:`component_config`).
COMPONENT_SECTIONS = ("worker", "exporter", "actions", "nodes")


@dataclass(frozen=True)
class Settings:
    """Everything a TrainGuard process needs to reach the stack."""

    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    clickhouse: ClickHouseConfig = field(default_factory=ClickHouseConfig)
    stack: StackConfig = field(default_factory=StackConfig)
    #: signatures on the control-plane topics (decisions, job specs, commands, worker control).
    signing: SigningConfig = field(default_factory=SigningConfig)
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
    """Defaults <- YAML file <- ``TRAINGUARD__*`` env vars; ``$TRAINGUARD_HOME`` sets stack.home
    (:func:`default_home` of ``environ`` when nothing does)."""
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
    if not settings.stack.home:
        settings = replace(settings, stack=replace(settings.stack, home=str(default_home(env))))
    return _derive_embedded_endpoints(settings, data, env)


def _derive_embedded_endpoints(settings: Settings, data: dict[str, Any], env: dict[str, str]) -> Settings:
    """With the embedded stack on custom ports, point clients at them unless set explicitly.

    With ``stack.cluster`` the local cluster's: every broker, replica 1's HTTP port, the cluster
    name for the migrations, and replication 3 / min in-sync 2 (capped by the brokers there)."""
    if not settings.stack.embedded:
        return settings
    kafka, ch, st = settings.kafka, settings.clickhouse, settings.stack

    def given(section: str, key: str) -> bool:
        return key in (data.get(section) or {}) or f"TRAINGUARD__{section.upper()}__{key.upper()}" in env

    if not given("kafka", "bootstrap_servers"):
        servers = st.cluster_bootstrap if st.cluster else f"127.0.0.1:{st.kafka_port}"
        kafka = replace(kafka, bootstrap_servers=servers)
    if not given("clickhouse", "port") and not ch.dsn:
        port = st.cluster_clickhouse_http_port if st.cluster else st.clickhouse_http_port
        ch = replace(ch, host="127.0.0.1", port=port)
    if st.cluster:
        if not given("clickhouse", "cluster") and not ch.dsn:
            ch = replace(ch, cluster=LOCAL_CLUSTER)
        rf, isr = kafka.replication_factor, kafka.min_insync_replicas
        if not given("kafka", "replication_factor"):
            rf = min(3, st.cluster_kafka_brokers)
        if not given("kafka", "min_insync_replicas"):
            isr = max(1, min(2, rf - 1))
        kafka = replace(kafka, replication_factor=rf, min_insync_replicas=isr)
    return replace(settings, kafka=kafka, clickhouse=ch)
