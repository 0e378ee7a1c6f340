"""The embedded ClickHouse server: Debian's ``clickhouse-server`` run as a plain process.

Config files are generated into ``<home>/clickhouse`` (HTTP and native ports on 127.0.0.1
only, data under the same folder).  When the binary is missing and we are root on Debian, the
package is installed with apt-get; otherwise the error says what to run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from trainguard.infra.config import LOCAL_CLUSTER, StackConfig
from trainguard.infra.stack.procs import ManagedProcess, StackError, port_in_use, wait_until

_CONFIG = """<?xml version="1.0"?>
<yandex>
  <logger>
    <level>warning</level>
    <log>{dir}/log/server.log</log>
    <errorlog>{dir}/log/error.log</errorlog>
    <size>50M</size>
    <count>3</count>
  </logger>
  <listen_host>127.0.0.1</listen_host>
  <http_port>{http_port}</http_port>
  <tcp_port>{tcp_port}</tcp_port>
  <path>{dir}/data/</path>
  <tmp_path>{dir}/tmp/</tmp_path>
  <user_files_path>{dir}/user_files/</user_files_path>
  <format_schema_path>{dir}/format_schemas/</format_schema_path>
  <users_config>{dir}/users.xml</users_config>
  <default_profile>default</default_profile>
  <default_database>default</default_database>
  <timezone>UTC</timezone>
  <mark_cache_size>268435456</mark_cache_size>
  <uncompressed_cache_size>268435456</uncompressed_cache_size>
  <max_concurrent_queries>100</max_concurrent_queries>
{cluster}</yandex>
"""

#: A replica's part of config.xml in the cluster stack: ZooKeeper, the one-shard cluster of every
#: replica, this replica's macros (``{{shard}}``/``{{replica}}`` in the ZooKeeper paths of the
#: tables) and the ON CLUSTER DDL queue.
_CLUSTER = """  <interserver_http_host>127.0.0.1</interserver_http_host>
  <interserver_http_port>{interserver_port}</interserver_http_port>
  <zookeeper>
    <node><host>127.0.0.1</host><port>{zk_port}</port></node>
    <session_timeout_ms>30000</session_timeout_ms>
  </zookeeper>
  <remote_servers>
    <{cluster}>
      <shard>
        <!-- Each insert goes to one replica; ReplicatedMergeTree copies it to the others. -->
        <internal_replication>true</internal_replication>
{replicas}      </shard>
    </{cluster}>
  </remote_servers>
  <macros><shard>1</shard><replica>r{index}</replica></macros>
  <distributed_ddl><path>/clickhouse/task_queue/ddl</path></distributed_ddl>
"""

_USERS = """<?xml version="1.0"?>
<yandex>
  <profiles>
    <default>
      <max_memory_usage>4000000000</max_memory_usage>
      <load_balancing>random</load_balancing>
    </default>
  </profiles>
  <users>
    <default>
      <password></password>
      <networks><ip>127.0.0.1</ip><ip>::1</ip></networks>
      <profile>default</profile>
      <quota>default</quota>
    </default>
  </users>
  <quotas>
    <default>
      <interval>
        <duration>3600</duration>
        <queries>0</queries><errors>0</errors><result_rows>0</result_rows>
        <read_rows>0</read_rows><execution_time>0</execution_time>
      </interval>
    </default>
  </quotas>
</yandex>
"""


def find_binary() -> list[str] | None:
    """The argv prefix that runs the server: ``clickhouse-server`` or ``clickhouse server``."""
    if exe := shutil.which("clickhouse-server"):
        return [exe]
    if exe := shutil.which("clickhouse"):
        return [exe, "server"]
    return None


def install_with_apt() -> list[str]:
    """Install Debian's clickhouse-server (root only); return the binary argv."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise StackError(
            "clickhouse-server is not installed; install it with "
            "`sudo apt-get install -y clickhouse-server clickhouse-client` (scripts/setup.sh does this)."
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "clickhouse-server", "clickhouse-client"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:  # stale package lists on a fresh machine
        subprocess.run(["apt-get", "update"], capture_output=True, env=env)
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    argv = find_binary()
    if res.returncode != 0 or argv is None:
        raise StackError(f"apt-get could not install clickhouse-server:\n{(res.stdout + res.stderr)[-2000:]}")
    return argv


@dataclass(frozen=True)
class ReplicaNode:
    """One ClickHouse server of a stack: the one-node stack's, or a replica of the cluster's."""

    name: str
    dir: Path
    http_port: int
    tcp_port: int
    #: where the other replicas fetch parts from this one (0: a lone server, none).
    interserver_port: int = 0
    #: the cluster stack's part of config.xml (empty: a lone server).
    cluster_xml: str = ""


def single_server(cfg: StackConfig) -> ReplicaNode:
    return ReplicaNode(
        "clickhouse", cfg.home_path / "clickhouse", cfg.clickhouse_http_port, cfg.clickhouse_tcp_port
    )


def cluster_replicas(cfg: StackConfig) -> list[ReplicaNode]:
    """The cluster stack's replicas (one shard), each knowing the others by their native port."""
    n = cfg.cluster_clickhouse_replicas
    http = cfg.cluster_ports(cfg.cluster_clickhouse_http_port, n)
    tcp = cfg.cluster_ports(cfg.cluster_clickhouse_tcp_port, n)
    inter = cfg.cluster_ports(cfg.cluster_clickhouse_interserver_port, n)
    replicas = "".join(f"        <replica><host>127.0.0.1</host><port>{p}</port></replica>\n" for p in tcp)
    return [
        ReplicaNode(
            f"clickhouse-{i + 1}",
            cfg.home_path / "cluster" / f"clickhouse-{i + 1}",
            http[i],
            tcp[i],
            inter[i],
            _CLUSTER.format(
                interserver_port=inter[i],
                zk_port=cfg.zookeeper_port,
                cluster=LOCAL_CLUSTER,
                replicas=replicas,
                index=i + 1,
            ),
        )
        for i in range(n)
    ]


class ClickHouseServer:
    """Write config, start/stop/check one local ClickHouse server."""

    def __init__(self, cfg: StackConfig, node: ReplicaNode | None = None) -> None:
        self.cfg = cfg
        self.node = node or single_server(cfg)
        self.dir = self.node.dir
        self.config_file = self.dir / "config.xml"
        self.proc = ManagedProcess(
            self.node.name,
            self.dir / "clickhouse.pid",
            self.dir / "log" / "stdout.log",
            str(self.config_file),
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.node.http_port}"

    def _write_config(self) -> None:
        for sub in ("data", "tmp", "user_files", "format_schemas", "log"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        d = escape(str(self.dir))
        self.config_file.write_text(
            _CONFIG.format(
                dir=d,
                http_port=self.node.http_port,
                tcp_port=self.node.tcp_port,
                cluster=self.node.cluster_xml,
            )
        )
        (self.dir / "users.xml").write_text(_USERS)

    def check_ports(self) -> None:
        """Fail with a clear message if another process holds one of our ports."""
        if self.proc.pid() is not None:
            return
        ports = [self.node.http_port, self.node.tcp_port]
        where = "stack.clickhouse_http_port / stack.clickhouse_tcp_port"
        if self.node.interserver_port:
            ports.append(self.node.interserver_port)
            where = (
                "stack.cluster_clickhouse_http_port / _tcp_port / _interserver_port "
                "(each replica takes the next port)"
            )
        for port in ports:
            if port_in_use(port):
                raise StackError(
                    f"port {port} is already in use by another process ({self.node.name} needs it); "
                    f"choose other ports with {where}."
                )

    def start(self) -> bool:
        if self.proc.pid() is not None:
            return False
        self.check_ports()
        argv = find_binary() or install_with_apt()
        self._write_config()
        self.proc.start([*argv, f"--config-file={self.config_file}"], cwd=self.dir)
        return True

    def wait_healthy(self, timeout_s: float) -> None:
        wait_until(self.healthy, timeout_s, "ClickHouse", self.proc)

    def healthy(self) -> bool:
        return self.proc.pid() is not None and ping(self.url)

    def stop(self) -> bool:
        return self.proc.stop(timeout_s=30)


def ping(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ping", timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False
