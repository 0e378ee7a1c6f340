"""The embedded Apache Kafka broker: KRaft single node (broker + controller), Java 17.

The broker's jars are resolved from Maven Central by Maven from ``infra/kafka/pom.xml`` and
cached under ``<cache_dir>/kafka-<pom hash>/libs`` (shared by every stack home), so a second
``stack up`` -- or a second home used by tests -- never downloads again (that first one shows
Maven's downloads as it goes: files and megabytes so far).  The log directory lives in the stack
home and is formatted once; restarts keep topics, data and group offsets.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import logging
import re
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from trainguard.infra.config import KafkaConfig, StackConfig
from trainguard.infra.progress import Progress, quiet
from trainguard.infra.stack.procs import ManagedProcess, StackError, port_in_use, wait_until

POM = Path(__file__).resolve().parent.parent / "kafka" / "pom.xml"

#: Maven's line for each file it fetched: ``Downloaded from central: <url> (3.4 kB at 12 kB/s)``.
_DOWNLOADED = re.compile(r"Downloaded from \S+: \S+(?: \((?P<size>[\d.]+) (?P<unit>[kMG]?B)\b)?")
_COPIED = re.compile(r"\bCopying \S+\.jar to ")
_BYTES = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}


class MavenOutput:
    """What Maven's output says so far: files downloaded (and their size), jars copied."""

    def __init__(self) -> None:
        self.downloaded = 0
        self.bytes = 0.0
        self.copied = 0
        #: the last lines, for the error message when Maven fails.
        self.tail: collections.deque[str] = collections.deque(maxlen=300)

    def feed(self, line: str) -> None:
        self.tail.append(line.rstrip("\n"))
        if m := _DOWNLOADED.search(line):
            self.downloaded += 1
            if m["size"]:
                self.bytes += float(m["size"]) * _BYTES[m["unit"]]
        elif _COPIED.search(line):
            self.copied += 1

    def summary(self) -> str:
        got = f"{self.downloaded} file(s) downloaded"
        if self.bytes:
            got += f" ({self.bytes / 1e6:.1f} MB)" if self.bytes >= 1e6 else f" ({self.bytes / 1e3:.0f} kB)"
        return got + (f", {self.copied} jar(s) copied" if self.copied else "")

    def errors(self) -> str:
        """Maven's [ERROR] lines (its INFO lines too when it printed none), at most 2000 chars."""
        lines = [ln for ln in self.tail if ln.startswith("[ERROR]")] or list(self.tail)
        return "\n".join(lines)[-2000:]


_LOG4J2 = """<Configuration status="WARN">
  <Appenders>
    <RollingFile name="F" fileName="{log}" filePattern="{log}.%i">
      <PatternLayout pattern="[%d] %p %m (%c)%n"/>
      <Policies><SizeBasedTriggeringPolicy size="20 MB"/></Policies>
      <DefaultRolloverStrategy max="3"/>
    </RollingFile>
  </Appenders>
  <Loggers>
    <Logger name="kafka" level="INFO"/>
    <Logger name="org.apache.kafka" level="INFO"/>
    <Logger name="state.change.logger" level="WARN"/>
    <Root level="WARN"><AppenderRef ref="F"/></Root>
  </Loggers>
</Configuration>
"""


@dataclass(frozen=True)
class BrokerNode:
    """One broker (and KRaft controller) of a stack: the one-node stack's, or one of the cluster's."""

    name: str
    node_id: int
    port: int
    controller_port: int
    #: the controller quorum, ``id@host:port`` of every voter (each broker is one).
    voters: str
    dir: Path
    heap_mb: int
    #: replication of Kafka's internal topics (group offsets, transactions): the cluster's brokers, at most 3.
    internal_replication: int = 1
    #: where the cluster id shared by every broker of the cluster is kept (None: one of its own).
    cluster_id_file: Path | None = None


def single_node(cfg: StackConfig) -> BrokerNode:
    """The one-node stack's broker (``stack up``)."""
    return BrokerNode(
        name="kafka",
        node_id=1,
        port=cfg.kafka_port,
        controller_port=cfg.kafka_controller_port,
        voters=f"1@127.0.0.1:{cfg.kafka_controller_port}",
        dir=cfg.home_path / "kafka",
        heap_mb=cfg.kafka_heap_mb,
    )


def cluster_nodes(cfg: StackConfig) -> list[BrokerNode]:
    """The cluster stack's brokers (``stack up --cluster``): every one a voter of the quorum."""
    n = cfg.cluster_kafka_brokers
    ports = cfg.cluster_ports(cfg.cluster_kafka_port, n)
    controllers = cfg.cluster_ports(cfg.cluster_kafka_controller_port, n)
    voters = ",".join(f"{i + 1}@127.0.0.1:{c}" for i, c in enumerate(controllers))
    home = cfg.home_path / "cluster"
    return [
        BrokerNode(
            name=f"kafka-{i + 1}",
            node_id=i + 1,
            port=ports[i],
            controller_port=controllers[i],
            voters=voters,
            dir=home / f"kafka-{i + 1}",
            heap_mb=cfg.cluster_kafka_heap_mb,
            internal_replication=min(3, n),
            cluster_id_file=home / "kafka-cluster-id",
        )
        for i in range(n)
    ]


def server_properties(node: BrokerNode, data_dir: Path) -> str:
    host = "127.0.0.1"
    rf = str(node.internal_replication)
    # With 3 replicas an internal topic keeps taking writes with one broker down.
    min_isr = str(max(1, node.internal_replication - 1))
    props = {
        "process.roles": "broker,controller",
        "node.id": str(node.node_id),
        "controller.quorum.voters": node.voters,
        "listeners": f"PLAINTEXT://{host}:{node.port},CONTROLLER://{host}:{node.controller_port}",
        "advertised.listeners": f"PLAINTEXT://{host}:{node.port}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(data_dir),
        "num.partitions": "1",
        # Topics come from the registry (`stack up` creates them); a typo must not invent a topic.
        "auto.create.topics.enable": "false",
        "offsets.topic.replication.factor": rf,
        "offsets.topic.num.partitions": "10",
        "transaction.state.log.replication.factor": rf,
        "transaction.state.log.min.isr": min_isr,
        "share.coordinator.state.topic.replication.factor": rf,
        "share.coordinator.state.topic.min.isr": min_isr,
        # Workers must be ready in seconds, not after the default 3 s rebalance delay.
        "group.initial.rebalance.delay.ms": "0",
        "message.max.bytes": str(16 * 1024 * 1024),
        "log.retention.check.interval.ms": "60000",
    }
    return "".join(f"{k}={v}\n" for k, v in props.items())


class KafkaServer:
    """Resolve jars, format storage once, start/stop/check one local broker."""

    def __init__(self, cfg: StackConfig, node: BrokerNode | None = None) -> None:
        self.cfg = cfg
        self.node = node or single_node(cfg)
        self.dir = self.node.dir
        self.data_dir = self.dir / "data"
        self.props_file = self.dir / "server.properties"
        self.proc = ManagedProcess(
            self.node.name, self.dir / "kafka.pid", self.dir / "server.log", str(self.props_file)
        )

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.node.port}"

    # -- installation ---------------------------------------------------------------------
    def libs_dir(self) -> Path:
        digest = hashlib.sha256(POM.read_bytes()).hexdigest()[:12]
        return self.cfg.cache_path / f"kafka-{digest}" / "libs"

    def ensure_jars(self, progress: Progress | None = None) -> Path:
        """Resolve the broker's jars with Maven once; later calls return the cached folder."""
        bar = progress or quiet()
        libs = self.libs_dir()
        if (libs / ".complete").exists():
            return libs
        mvn = shutil.which("mvn")
        if mvn is None:
            raise StackError(
                "Maven (mvn) is needed once to fetch the Kafka broker jars from Maven Central; "
                "install it with `apt-get install -y maven` (scripts/setup.sh does this)."
            )
        tmp = libs.with_name("libs.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        # Not -q: Maven's "Downloaded from" and "Copying" lines are the progress of a first start,
        # which otherwise sits silent for the minute or more the download takes.  -B: no
        # per-byte transfer lines, no colours.
        cmd = [
            mvn,
            "-B",
            "-f",
            str(POM),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={tmp}",
            "-DincludeScope=runtime",
        ]
        bar.phase("kafka: resolving the broker's jars with Maven (once)")
        out = MavenOutput()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True
        )
        assert proc.stdout is not None
        with proc:
            for line in proc.stdout:
                out.feed(line)
                bar.update(detail=out.summary())
        if proc.returncode != 0 or not any(tmp.glob("kafka_2.13-*.jar")):
            raise StackError(
                f"Maven could not resolve the Kafka broker from Maven Central (exit {proc.returncode}):\n"
                f"{out.errors()}"
            )
        (tmp / ".complete").write_text("ok\n")
        shutil.rmtree(libs, ignore_errors=True)
        tmp.rename(libs)
        return libs

    @staticmethod
    def java() -> str:
        java = shutil.which("java")
        if java is None:
            raise StackError(
                "Java 17+ is needed for the Kafka broker; install it with "
                "`apt-get install -y openjdk-17-jre-headless` (scripts/setup.sh does this)."
            )
        out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
        m = re.search(r'version "(\d+)', out)
        if m and int(m.group(1)) < 17:
            raise StackError(f"Kafka 4 needs Java 17 or newer; found: {out.splitlines()[0]}")
        return java

    # -- lifecycle --------------------------------------------------------------------------
    def _write_config(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.props_file.write_text(server_properties(self.node, self.data_dir))
        (self.dir / "log4j2.xml").write_text(_LOG4J2.format(log=self.dir / "broker.log"))

    def _format_once(self, java: str, libs: Path, progress: Progress) -> None:
        if (self.data_dir / "meta.properties").exists():
            return
        progress.phase(f"{self.node.name}: formatting the log dir (once)")
        cluster_id = self.cluster_id()
        cmd = [
            java,
            "-cp",
            f"{libs}/*",
            "kafka.tools.StorageTool",
            "format",
            # One argument: a base64 id may start with "-", which argparse takes for an option.
            f"--cluster-id={cluster_id}",
            "-c",
            str(self.props_file),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise StackError(f"formatting the Kafka log dir failed:\n{(res.stdout + res.stderr)[-2000:]}")

    def cluster_id(self) -> str:
        """The id the log dir is formatted with: every broker of a cluster must share one."""
        fresh = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        path = self.node.cluster_id_file
        if path is None:
            return fresh
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(fresh + "\n")
        return path.read_text().strip()

    def check_ports(self) -> None:
        """Fail with a clear message if another process holds one of our ports."""
        if self.proc.pid() is not None:
            return
        for port in (self.node.port, self.node.controller_port):
            if port_in_use(port):
                where = (
                    "stack.kafka_port / stack.kafka_controller_port (TRAINGUARD__STACK__KAFKA_PORT)"
                    if self.node.cluster_id_file is None
                    else "stack.cluster_kafka_port / stack.cluster_kafka_controller_port (each broker "
                    "takes the next port)"
                )
                raise StackError(
                    f"port {port} is already in use by another process ({self.node.name} needs it); "
                    f"choose other ports with {where}."
                )

    def start(self, progress: Progress | None = None) -> bool:
        """Start the broker unless it runs already. Returns True if it was started now."""
        if self.proc.pid() is not None:
            return False
        bar = progress or quiet()
        self.check_ports()
        java = self.java()
        libs = self.ensure_jars(bar)
        self._write_config()
        self._format_once(java, libs, bar)
        bar.phase(f"{self.node.name}: starting the broker")
        heap = f"-Xmx{self.node.heap_mb}m"
        argv = [
            java,
            heap,
            f"-Xms{min(256, self.node.heap_mb)}m",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.dir / 'log4j2.xml'}",
            "-cp",
            f"{libs}/*",
            "kafka.Kafka",
            str(self.props_file),
        ]
        self.proc.start(argv, cwd=self.dir)
        return True

    def wait_healthy(self, timeout_s: float) -> None:
        wait_until(lambda: self.healthy(2.0), timeout_s, f"Kafka ({self.node.name})", self.proc)

    def healthy(self, timeout_s: float = 3.0) -> bool:
        return self.proc.pid() is not None and broker_reachable(
            KafkaConfig(bootstrap_servers=self.bootstrap), timeout_s
        )

    def stop(self) -> bool:
        return self.proc.stop(timeout_s=60)


def broker_reachable(cfg: KafkaConfig, timeout_s: float = 3.0) -> bool:
    """True if the cluster answers a metadata request (any broker of ``bootstrap_servers``)."""
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    kw = cfg.client_kwargs()
    kw["request_timeout_ms"] = int(timeout_s * 1000)
    try:
        admin = KafkaAdminClient(**kw, bootstrap_timeout_ms=int(timeout_s * 1000))
    except (KafkaError, OSError, ValueError):
        return False
    try:
        admin.list_topics()
        return True
    except (KafkaError, OSError):
        return False
    finally:
        admin.close()
