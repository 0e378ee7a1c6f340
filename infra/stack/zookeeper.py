"""The cluster stack's ZooKeeper: Debian's ``zookeeper`` package run as a plain standalone process.

ClickHouse 18.16 replicates ``Replicated*`` tables and runs ``ON CLUSTER`` DDL through ZooKeeper
(it has no Keeper of its own).  One standalone server is enough for a local cluster: it is a
single point of failure there, which is what a chaos run that restarts it wants to show.  Config
and data live in ``<home>/cluster/zookeeper``; the JVM heap is small (``stack.zookeeper_heap_mb``).
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from trainguard.infra.config import StackConfig
from trainguard.infra.stack.procs import ManagedProcess, StackError, port_in_use, wait_until

#: Debian's jar; its manifest's Class-Path names every dependency under /usr/share/java.
ZOOKEEPER_JAR = Path("/usr/share/java/zookeeper.jar")


def zoo_cfg(port: int, data_dir: Path) -> str:
    props = {
        "tickTime": "2000",
        "dataDir": str(data_dir),
        "clientPort": str(port),
        "clientPortAddress": "127.0.0.1",
        # No admin HTTP server: it would take port 8080, shared by every stack on the machine.
        "admin.enableServer": "false",
        # ClickHouse asks "ruok"-style commands nowhere; the health check below uses "srvr".
        "4lw.commands.whitelist": "srvr,ruok",
        "maxClientCnxns": "200",
        # Snapshots and logs of a test cluster: keep the last three, purge hourly.
        "autopurge.snapRetainCount": "3",
        "autopurge.purgeInterval": "1",
    }
    return "".join(f"{k}={v}\n" for k, v in props.items())


def answers(port: int, timeout_s: float = 2.0) -> bool:
    """True if a ZooKeeper serves on ``port`` (its ``srvr`` four-letter command says ``Mode:``)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"srvr")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
    except OSError:
        return False
    return b"Mode:" in data


class ZooKeeperServer:
    """Write config, start/stop/check the cluster stack's ZooKeeper."""

    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        self.dir = cfg.home_path / "cluster" / "zookeeper"
        self.config_file = self.dir / "zoo.cfg"
        self.proc = ManagedProcess(
            "zookeeper", self.dir / "zookeeper.pid", self.dir / "server.log", str(self.config_file)
        )

    def check_ports(self) -> None:
        if self.proc.pid() is None and port_in_use(self.cfg.zookeeper_port):
            raise StackError(
                f"port {self.cfg.zookeeper_port} is already in use by another process; choose another "
                "with stack.zookeeper_port (TRAINGUARD__STACK__ZOOKEEPER_PORT)."
            )

    def start(self, java: str) -> bool:
        """Start ZooKeeper unless it runs already.  Returns True if it was started now."""
        if self.proc.pid() is not None:
            return False
        if not ZOOKEEPER_JAR.exists():
            raise StackError(
                "ZooKeeper is needed by the cluster stack's ClickHouse replicas; install it with "
                "`apt-get install -y --no-install-recommends zookeeper` (scripts/setup.sh does this)."
            )
        self.check_ports()
        (self.dir / "data").mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(zoo_cfg(self.cfg.zookeeper_port, self.dir / "data"))
        heap = self.cfg.zookeeper_heap_mb
        argv = [
            java,
            f"-Xmx{heap}m",
            f"-Xms{min(64, heap)}m",
            "-Djava.awt.headless=true",
            "-cp",
            str(ZOOKEEPER_JAR),
            "org.apache.zookeeper.server.quorum.QuorumPeerMain",
            str(self.config_file),
        ]
        self.proc.start(argv, cwd=self.dir)
        return True

    def wait_healthy(self, timeout_s: float) -> None:
        wait_until(self.healthy, timeout_s, "ZooKeeper", self.proc)

    def healthy(self) -> bool:
        return self.proc.pid() is not None and answers(self.cfg.zookeeper_port)

    def stop(self) -> bool:
        return self.proc.stop(timeout_s=30)

    def wipe(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
