"""A private local Kubernetes control plane for the embedded stack (``trainguard stack up --k8s``).

Real Kubernetes, built from its Go modules and run as plain processes owned by the stack home
(everything under ``<home>/k8s``): ``etcd``, ``kube-apiserver`` (token auth, RBAC, its own
self-signed serving certificate), ``kube-scheduler``, ``kube-controller-manager``, and kwok as the
kubelet of every node.  kwok manages the Node objects the stack creates (``n1..nN``, annotated
``kwok.x-k8s.io/node: fake``, with network-position labels) and moves the pods bound to them to
Running; the stack's pod runner (:mod:`trainguard.infra.stack.podrunner`) then runs each opted-in pod's
container command as a local process, so the training a pod stands for is real.

**The build.**  The binaries are built once per machine into ``<cache>/k8s-<version>/bin`` from
``infra/k8s/controlplane`` (a Go module requiring ``k8s.io/kubernetes`` with its staging modules
pinned by ``replace`` lines; ``go.sum`` committed) and kwok by ``go install`` at a pinned version;
a later ``stack up --k8s`` reuses them.  Cold, the build takes minutes (README: measured): the
progress line names the binary being built, its time so far and the Go modules downloaded (from
the build log's ``go: downloading`` lines).

**Clients.**  ``stack up --k8s`` writes two kubeconfigs: ``admin.kubeconfig`` (``system:masters``:
the stack's own components, kubectl for an operator) and ``executor.kubeconfig`` (user
``trainguard-executor``, only what ``infra/deploy/k8s/base/rbac.yaml`` grants the action
service's ``kubernetes`` executor).  Both trust the API server's self-signed CA.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.infra.config import StackConfig
from trainguard.infra.progress import Progress, quiet
from trainguard.infra.stack.procs import ManagedProcess, StackError, port_in_use, wait_until
from trainguard.schemas.typecheck import bounds

_PORT = bounds(1, 65535)

#: the Kubernetes release the control plane is built at (go.mod's k8s.io/kubernetes).
K8S_VERSION = "v1.34.4"
KWOK_VERSION = "v0.7.0"
#: where the Go module that builds the control plane lives (go.mod, go.sum, tools.go).
MODULE_DIR = Path(__file__).resolve().parent.parent / "k8s" / "controlplane"
#: binary -> Go package built from MODULE_DIR.
_BUILT = {
    "etcd": "go.etcd.io/etcd/server/v3",
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
    "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
}
BINARIES = (*_BUILT, "kwok")
#: kwok's pod stages: its own, except that the pod runner finishes local-run pods' deletions.
KWOK_STAGES = MODULE_DIR.parent / "kwok-stages.yaml"

#: the annotation kwok manages nodes by (``--manage-nodes-with-annotation-selector``).
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
#: users of the token file: the stack's admin and the action service's executor.
ADMIN_USER = "trainguard-admin"
EXECUTOR_USER = "trainguard-executor"
#: node labels giving a node's network position (Arnold's pod / rack), read by placement.
ZONE_LABEL = "topology.kubernetes.io/zone"
RACK_LABEL = "trainguard.io/rack"


@dataclass(frozen=True)
class K8sConfig:
    """Shape and ports of the private control plane (from ``stack.k8s_*``)."""

    nodes: int = field(default=12, metadata=bounds(1, 500))
    #: nodes per network pod (zone) and per rack, for the topology labels.
    nodes_per_pod: int = field(default=6, metadata=bounds(1, 10_000))
    nodes_per_rack: int = field(default=2, metadata=bounds(1, 10_000))
    etcd_port: int = field(default=12379, metadata=_PORT)
    etcd_peer_port: int = field(default=12380, metadata=_PORT)
    apiserver_port: int = field(default=16443, metadata=_PORT)
    #: where the built binaries are; empty: ``<cache>/k8s-<version>/bin``.
    bin_dir: str = ""
    #: each node's advertised capacity.
    gpus_per_node: int = field(default=8, metadata=bounds(0, 64))
    cpus_per_node: int = field(default=32, metadata=bounds(1, 4096))

    @classmethod
    def from_stack(cls, cfg: StackConfig, nodes: int | None = None) -> K8sConfig:
        return cls(
            nodes=cfg.k8s_nodes if nodes is None else nodes,
            etcd_port=cfg.k8s_etcd_port,
            etcd_peer_port=cfg.k8s_etcd_port + 1,
            apiserver_port=cfg.k8s_apiserver_port,
            bin_dir=cfg.k8s_bin_dir or str(cfg.cache_path / f"k8s-{K8S_VERSION}" / "bin"),
        )

    @property
    def node_names(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.nodes + 1)]

    @property
    def ports(self) -> list[int]:
        return [self.etcd_port, self.etcd_peer_port, self.apiserver_port]

    def labels(self, node: str) -> dict[str, str]:
        """The node's labels: hostname, network pod (zone) and rack, the kwok type."""
        i = int(node[1:]) - 1
        return {
            "kubernetes.io/hostname": node,
            "kubernetes.io/os": "linux",
            "type": "kwok",
            ZONE_LABEL: f"pod-{i // self.nodes_per_pod}",
            RACK_LABEL: f"rack-{i // self.nodes_per_rack}",
        }


def go_binary() -> str:
    path = shutil.which("go") or shutil.which("go", path="/usr/local/go/bin:/usr/lib/go/bin")
    if path is None:
        raise StackError("go not found: the Kubernetes control plane is built from Go modules (Go >= 1.24)")
    return path


class _LogWatch:
    """Counts the ``go: downloading <module>`` lines a build appends to its log."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.modules, self._partial = path, 0, 0, b""

    def poll(self) -> int:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except OSError:
            return self.modules
        self.offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        self.modules += sum(1 for ln in lines if ln.startswith(b"go: downloading "))
        return self.modules


def build_binaries(bin_dir: Path, progress: Progress | None = None) -> dict[str, float]:
    """Build the missing control-plane binaries into ``bin_dir``; returns seconds per binary built."""
    bar = progress or quiet()
    bin_dir.mkdir(parents=True, exist_ok=True)
    go = go_binary()
    env = {**os.environ, "GOFLAGS": "-mod=mod", "CGO_ENABLED": "0"}
    built: dict[str, float] = {}
    # What `make` stamps into a release build: /version and kubectl's skew check read it.
    major, minor = K8S_VERSION.lstrip("v").split(".")[:2]
    stamp = " ".join(
        f"-X {pkg}.{key}={value}"
        for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
        for key, value in (("gitVersion", K8S_VERSION), ("gitMajor", major), ("gitMinor", minor))
    )
    jobs: list[tuple[str, list[str], Path | None, dict[str, str]]] = [
        (
            name,
            [go, "build", "-trimpath", f"-ldflags={stamp}", "-o", str(bin_dir / f"{name}.tmp"), pkg],
            MODULE_DIR,
            env,
        )
        for name, pkg in _BUILT.items()
    ]
    # kwok's own module pins its own Kubernetes libraries: go install builds it as released.
    kwok_env = {**env, "GOBIN": str(bin_dir / ".kwok")}
    kwok_env.pop("GOFLAGS")
    jobs.append(("kwok", [go, "install", f"sigs.k8s.io/kwok/cmd/kwok@{KWOK_VERSION}"], None, kwok_env))
    missing = [j for j in jobs if not (bin_dir / j[0]).exists()]
    for n, (name, argv, cwd, jenv) in enumerate(missing, 1):
        # A phase per binary: each one built leaves its line with its time (the README's numbers).
        bar.phase(f"k8s: building {name} ({n}/{len(missing)}; cached in {bin_dir} for later starts)")
        t0 = time.monotonic()
        log = bin_dir / f"{name}.build.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, cwd=cwd, env=jenv, stdout=out, stderr=subprocess.STDOUT)
            watch = _LogWatch(log)
            while proc.poll() is None:
                time.sleep(1)
                if modules := watch.poll():
                    bar.update(detail=f"{modules} Go module(s) downloaded")
                bar.tick()
        if proc.returncode != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise StackError(f"building {name} failed (exit {proc.returncode}); {log}:\n{tail}")
        src = bin_dir / ".kwok" / "kwok" if name == "kwok" else bin_dir / f"{name}.tmp"
        src.replace(bin_dir / name)
        built[name] = time.monotonic() - t0
    return built


class K8sCluster:
    """Start, stop and inspect the stack home's private Kubernetes control plane."""

    def __init__(self, stack: StackConfig, nodes: int | None = None) -> None:
        self.stack = stack
        self.dir = stack.home_path / "k8s"
        self.cfg = K8sConfig.from_stack(stack, nodes if nodes is not None else self._recorded_nodes())
        self.bin_dir = Path(self.cfg.bin_dir).expanduser()
        self.admin_kubeconfig = self.dir / "admin.kubeconfig"
        self.executor_kubeconfig = self.dir / "executor.kubeconfig"
        self.cert_dir = self.dir / "pki"
        pids, logs = self.dir / "pids", self.dir / "log"
        # Ownership markers: each process's command line holds a path unique to this home.
        self.etcd = ManagedProcess("etcd", pids / "etcd.pid", logs / "etcd.log", str(self.dir / "etcd"))
        self.apiserver = ManagedProcess(
            "kube-apiserver", pids / "apiserver.pid", logs / "apiserver.log", str(self.cert_dir)
        )
        marker = str(self.admin_kubeconfig)
        self.scheduler = ManagedProcess(
            "kube-scheduler", pids / "scheduler.pid", logs / "scheduler.log", marker
        )
        self.controllers = ManagedProcess(
            "kube-controller-manager", pids / "controllers.pid", logs / "controllers.log", marker
        )
        self.kwok = ManagedProcess("kwok", pids / "kwok.pid", logs / "kwok.log", marker)
        self.podrunner = ManagedProcess(
            "pod runner", pids / "podrunner.pid", logs / "podrunner.log", str(self.dir / "pods")
        )

    @property
    def processes(self) -> list[ManagedProcess]:
        """In start order."""
        return [self.etcd, self.apiserver, self.scheduler, self.controllers, self.kwok, self.podrunner]

    def _recorded_nodes(self) -> int | None:
        try:
            return int((self.dir / "nodes").read_text().strip())
        except (OSError, ValueError):
            return None

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.cfg.apiserver_port}"

    def running(self) -> bool:
        return self.apiserver.pid() is not None

    def check_ports(self) -> None:
        if self.running():
            return
        for port in self.cfg.ports:
            if port_in_use(port):
                raise StackError(
                    f"port {port} is already in use by another process; choose other Kubernetes ports "
                    "with stack.k8s_etcd_port / stack.k8s_apiserver_port (TRAINGUARD__STACK__K8S_*)."
                )

    def binary(self, name: str) -> str:
        path = self.bin_dir / name
        if not path.exists():
            raise StackError(f"{path} missing: `trainguard stack up --k8s` builds it (or scripts/setup.sh)")
        return str(path)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, progress: Progress | None = None) -> list[str]:
        """Build what is missing, start what is not running; returns the names started now."""
        bar = progress or quiet()
        if self.running():
            want = self._recorded_nodes()
            if want is not None and want != self.cfg.nodes:
                raise StackError(
                    f"the Kubernetes of {self.stack.home_path} runs {want} nodes, not {self.cfg.nodes}: "
                    "run `trainguard stack down` first to change the node count"
                )
        else:
            self.check_ports()
        build_binaries(self.bin_dir, bar)
        bar.phase("k8s: starting the control plane")
        for sub in ("pids", "log", "etcd", "pki", "pods"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.dir.chmod(0o700)  # tokens and keys
        (self.dir / "nodes").write_text(str(self.cfg.nodes))
        tokens = self._tokens()
        started: list[str] = []
        timeout = self.stack.start_timeout_s
        if self.etcd.pid() is None:
            self._start_etcd()
            started.append("etcd")
        if self.apiserver.pid() is None:
            self._start_apiserver()
            started.append("kube-apiserver")
        bar.phase("k8s: waiting until kube-apiserver is ready")
        wait_until(self._ready, timeout, "kube-apiserver", self.apiserver)
        bar.phase("k8s: starting the scheduler, controllers and kwok")
        self._write_kubeconfigs(tokens)
        common = [f"--kubeconfig={self.admin_kubeconfig}", "--leader-elect=false", "--secure-port=0"]
        if self.scheduler.pid() is None:
            self.scheduler.start([self.binary("kube-scheduler"), *common])
            started.append("kube-scheduler")
        if self.controllers.pid() is None:
            self.controllers.start(
                [
                    self.binary("kube-controller-manager"),
                    *common,
                    f"--service-account-private-key-file={self.cert_dir / 'sa.key'}",
                    "--use-service-account-credentials=false",
                    # No token controller: tokens come from the API server's TokenRequest.
                    "--controllers=*,-serviceaccount-token",
                    # Every node's heartbeat comes from the one kwok process, which a host busy with
                    # the training it stands for can starve for tens of seconds: the default 50 s
                    # grace made an idle standby node "unreachable" in a demo run.  A real
                    # cluster keeps its own setting; here a node is lost only when it is deleted.
                    "--node-monitor-grace-period=5m",
                ]
            )
            started.append("kube-controller-manager")
        if self.kwok.pid() is None:
            key, value = KWOK_ANNOTATION
            self.kwok.start(
                [
                    self.binary("kwok"),
                    f"--kubeconfig={self.admin_kubeconfig}",
                    "--manage-all-nodes=false",
                    f"--manage-nodes-with-annotation-selector={key}={value}",
                    f"--config={KWOK_STAGES}",
                    "--server-address=",
                ]
            )
            started.append("kwok")
        from trainguard.infra.k8s.bootstrap import bootstrap

        bar.phase(f"k8s: creating {self.cfg.nodes} node(s), waiting until they are Ready")
        bootstrap(self, timeout)
        if self.podrunner.pid() is None:
            import sys

            self.podrunner.start(
                [
                    sys.executable, "-m", "trainguard.infra.stack.podrunner",
                    "--kubeconfig", str(self.admin_kubeconfig), "--dir", str(self.dir / "pods"),
                ]
            )  # fmt: skip
            started.append("pod runner")
        return started

    def _tokens(self) -> dict[str, str]:
        """The token file (one random token per user), created once per home."""
        path = self.dir / "tokens.csv"
        if not path.exists():
            rows = [
                (secrets.token_hex(24), ADMIN_USER, "system:masters"),
                (secrets.token_hex(24), EXECUTOR_USER, "trainguard:executors"),
            ]
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                for token, user, group in rows:
                    f.write(f'{token},{user},{user},"{group}"\n')
        out = {}
        for line in path.read_text().splitlines():
            token, user = line.split(",")[:2]
            out[user] = token
        return out

    def _start_etcd(self) -> None:
        c = self.cfg
        self.etcd.start(
            [
                self.binary("etcd"),
                f"--data-dir={self.dir / 'etcd'}",
                "--name=trainguard",
                f"--listen-client-urls=http://127.0.0.1:{c.etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{c.etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{c.etcd_peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{c.etcd_peer_port}",
                f"--initial-cluster=trainguard=http://127.0.0.1:{c.etcd_peer_port}",
                # A test cluster on a shared disk: no fsync per write.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ]
        )

    def _start_apiserver(self) -> None:
        sa_key = self.cert_dir / "sa.key"
        if not sa_key.exists():
            from cryptography.hazmat.primitives import serialization
            from cryptography.hazmat.primitives.asymmetric import rsa

            key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            pem = key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            fd = os.open(sa_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
        self.apiserver.start(
            [
                self.binary("kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{self.cfg.etcd_port}",
                f"--service-account-key-file={sa_key}",
                f"--service-account-signing-key-file={sa_key}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--secure-port={self.cfg.apiserver_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--cert-dir={self.cert_dir}",
                f"--token-auth-file={self.dir / 'tokens.csv'}",
                "--authorization-mode=Node,RBAC",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--anonymous-auth=false",
                "--enable-priority-and-fairness=false",
            ]
        )

    def _ready(self) -> bool:
        if not (self.cert_dir / "apiserver.crt").exists() or not (self.dir / "tokens.csv").exists():
            return False
        import ssl
        import urllib.request

        token = self._tokens()[ADMIN_USER]
        ctx = ssl.create_default_context(cafile=str(self.cert_dir / "apiserver.crt"))
        req = urllib.request.Request(f"{self.server}/readyz", headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=2) as resp:
                return bool(resp.status == 200)
        except (OSError, ValueError):
            return False

    def _write_kubeconfigs(self, tokens: dict[str, str]) -> None:
        import yaml

        for path, user in ((self.admin_kubeconfig, ADMIN_USER), (self.executor_kubeconfig, EXECUTOR_USER)):
            doc = {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "trainguard",
                        "cluster": {
                            "server": self.server,
                            "certificate-authority": str(self.cert_dir / "apiserver.crt"),
                        },
                    }
                ],
                "users": [{"name": user, "user": {"token": tokens[user]}}],
                "contexts": [{"name": user, "context": {"cluster": "trainguard", "user": user}}],
                "current-context": user,
            }
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                yaml.safe_dump(doc, f)
            tmp.replace(path)

    def stop(self) -> list[str]:
        """Stop this home's processes (reverse start order); returns those stopped."""
        stopped = []
        for proc in reversed(self.processes):
            if proc.stop(timeout_s=15):
                stopped.append(proc.name)
        return stopped

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "running": self.running(),
            "server": self.server,
            "kubeconfig": str(self.admin_kubeconfig),
            "executor_kubeconfig": str(self.executor_kubeconfig),
            "pids": {p.name: p.pid() for p in self.processes},
            "nodes": [],
            "healthy": False,
        }
        if out["running"]:
            try:
                from trainguard.infra.k8s.bootstrap import node_states

                out["nodes"] = node_states(self)
            except Exception as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"
            down = [p for p, pid in out["pids"].items() if pid is None]
            out["healthy"] = bool(out["nodes"]) and not down and self._ready()
            if down:
                out["error"] = f"not running: {', '.join(down)}"
        return out


def main(argv: list[str] | None = None) -> int:
    """``python -m trainguard.infra.stack.k8s --build``: build the control plane (what setup.sh runs)."""
    import argparse

    from trainguard.infra.config import load_settings

    p = argparse.ArgumentParser(prog="python -m trainguard.infra.stack.k8s")
    p.add_argument("--build", action="store_true", help="build the missing binaries and exit")
    a = p.parse_args(argv)
    if not a.build:
        p.error("nothing to do (--build)")
    cluster = K8sCluster(load_settings().stack)
    try:
        with Progress("k8s build", summary=False) as bar, bar.ticking():
            built = build_binaries(cluster.bin_dir, bar)
    except StackError as exc:
        print(f"k8s build: {exc}")
        return 1
    what = ", ".join(f"{k} {v:.0f}s" for k, v in built.items()) or "nothing (cached)"
    print(f"k8s: control plane {K8S_VERSION} + kwok {KWOK_VERSION} in {cluster.bin_dir}; built: {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
