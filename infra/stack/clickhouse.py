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
from xml.sax.saxutils import escape

from trainguard.infra.config import StackConfig
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
</yandex>
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


class ClickHouseServer:
    """Write config, start/stop/check the local ClickHouse server."""

    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        self.dir = cfg.home_path / "clickhouse"
        self.config_file = self.dir / "config.xml"
        self.proc = ManagedProcess(
            "clickhouse", self.dir / "clickhouse.pid", self.dir / "log" / "stdout.log", str(self.config_file)
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.cfg.clickhouse_http_port}"

    def _write_config(self) -> None:
        for sub in ("data", "tmp", "user_files", "format_schemas", "log"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        d = escape(str(self.dir))
        self.config_file.write_text(
            _CONFIG.format(
                dir=d, http_port=self.cfg.clickhouse_http_port, tcp_port=self.cfg.clickhouse_tcp_port
            )
        )
        (self.dir / "users.xml").write_text(_USERS)

    def check_ports(self) -> None:
        """Fail with a clear message if another process holds one of our ports."""
        if self.proc.pid() is not None:
            return
        for port in (self.cfg.clickhouse_http_port, self.cfg.clickhouse_tcp_port):
            if port_in_use(port):
                raise StackError(
                    f"port {port} is already in use by another process; choose other ports with "
                    "stack.clickhouse_http_port / stack.clickhouse_tcp_port."
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
