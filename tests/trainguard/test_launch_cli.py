"""``trainguard launch`` as a process, with a Slurm task's environment set by hand (no Slurm, no Kafka).

The training command is a tiny Python child; the tests check what it saw, the launcher's exit code
(the child's, or 128 + the signal that killed it), signal forwarding, readiness, that rank 0
runs the training when the job spec cannot be published (Kafka away, no signing key), and what
the launcher tells the node exporter (a test socket bound as the exporter binds it): the rank's
registration, also to an exporter started later, and the rank's exit status, SIGKILL included.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.net import free_port
from tests.waiting import wait_until
from trainguard.infra.proctable import ProcTable
from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.codec import decode
from trainguard.schemas.enums import ProcessRole
from trainguard.schemas.workload import ProcessExit, RankRegistration
from trainguard.streams.exporter.sources.reporter import MAX_DATAGRAM, Peer, bind_socket, peer_of

TRAINGUARD = shutil.which("trainguard", path=str(Path(sys.executable).parent)) or "trainguard"
SEEN = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TRAINGUARD_JOB",
    "TRAINGUARD_RANK",
    "TRAINGUARD_NODE",
    "TRAINGUARD_REPORTER_SOCKET",
    "SLURM_PROCID",
)
#: signals the launcher (argv[1]) every 2 ms for at most 3 s, while it is one (a gone or
#: reaped launcher ends it: its pid must not be signalled once reused).
STORM = textwrap.dedent(
    """
    import os, signal, sys, time
    pid, end = int(sys.argv[1]), time.monotonic() + 3
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                alive = fh.read().rsplit(")", 1)[1].split()[0] != "Z"
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                alive = alive and b"launch" in fh.read()
            if not alive:
                break
            os.kill(pid, signal.SIGTERM)
        except (OSError, IndexError):
            break
        time.sleep(0.002)
    """
)
#: the child: writes the variables it saw to argv[1]; then, per argv[2]: "exit3" exits 3, "wait"
#: waits for the ready file argv[3] and exits 3, "sleep" sleeps (SIGTERM kills it), "usr1" exits
#: 10 on SIGUSR1 (after writing argv[3], so the test knows the handler is in place), "storm" has
#: the launcher signalled every 2 ms, from before this child exits 3 until the launcher is gone.
CHILD = textwrap.dedent(
    f"""
    STORM = {STORM!r}
    import json, os, pathlib, signal, sys, time
    out, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
    out.write_text(json.dumps({{k: os.environ.get(k) for k in {SEEN!r}}}))
    if mode == "usr1":
        signal.signal(signal.SIGUSR1, lambda *_: sys.exit(10))
        pathlib.Path(sys.argv[3]).write_text("armed")
    if mode == "wait":
        while not pathlib.Path(sys.argv[3]).exists():
            time.sleep(0.05)
    if mode in ("sleep", "usr1"):
        time.sleep(60)
    if mode == "storm":  # SIGTERM the launcher every 2 ms while this child exits 3 (and after)
        import subprocess
        subprocess.Popen([sys.executable, "-c", STORM, str(os.getppid())], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(0.3)
    sys.exit(3)
    """
)


def task_env(tmp_path: Path, rank: int, **extra: str) -> dict[str, str]:
    """Rank ``rank`` of ``srun -N 2 --ntasks-per-node=2`` in a 3-node allocation; TrainGuard's home
    is empty and its Kafka a port nobody listens on."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "TRAINGUARD"))}
    env.update(
        SLURM_JOB_ID="4242",
        SLURM_STEP_ID="0",
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank % 2),
        SLURM_NTASKS="4",
        SLURM_TASKS_PER_NODE="2(x2)",
        SLURM_STEP_NODELIST="n[1-2]",
        SLURM_JOB_NODELIST="n[1-3]",
        SLURMD_NODENAME=f"n{rank // 2 + 1}",
        TRAINGUARD_HOME=str(tmp_path / "home"),
        TRAINGUARD__KAFKA__BOOTSTRAP_SERVERS=f"127.0.0.1:{free_port()}",
    )
    env.update(extra)
    return env


def launch(tmp_path: Path, env: dict[str, str], mode: str, *options: str) -> subprocess.Popen[str]:
    argv = [TRAINGUARD, "launch", "--job", "llm", "--tp", "2", *options, "--"]
    argv += [sys.executable, "-c", CHILD, str(tmp_path / "seen.json"), mode, str(tmp_path / "ready.json")]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout_s)
    assert "Traceback" not in err, err
    return proc.returncode, out, err


def test_child_sees_its_rank_and_its_exit_code_is_the_launchers(tmp_path: Path) -> None:
    env = task_env(tmp_path, 3, TRAINGUARD_REPORTER_SOCKET="/run/site/reporter.sock")
    rc, out, err = finish(launch(tmp_path, env, "exit3", "--ready-file", str(tmp_path / "ready.json")))
    assert rc == 3, err
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "24242",
        "TRAINGUARD_JOB": "llm",
        "TRAINGUARD_RANK": "3",
        "TRAINGUARD_NODE": "n2",
        "TRAINGUARD_REPORTER_SOCKET": "/run/site/reporter.sock",
        "SLURM_PROCID": "3",  # the launcher's own environment is passed on
    }
    assert out.splitlines()[0] == "trainguard launch: job llm rank 3 on n2 ready"
    ready = json.loads((tmp_path / "ready.json").read_text())
    assert (ready["rank"], ready["node"], ready["world_size"], ready["spec"]["state"]) == (
        3,
        "n2",
        4,
        "not published",
    )
    assert "job spec" not in err  # only rank 0 publishes


def test_sigterm_is_forwarded_and_a_child_killed_by_it_gives_143(tmp_path: Path) -> None:
    proc = launch(tmp_path, task_env(tmp_path, 1), "sleep", "--ready-file", str(tmp_path / "ready.json"))
    try:
        wait_until(lambda: (tmp_path / "ready.json").exists(), 30, "the launcher ready")
        child = json.loads((tmp_path / "ready.json").read_text())["pid"]
        assert child != proc.pid
        proc.send_signal(signal.SIGTERM)
        rc, _, err = finish(proc, 30)
    finally:
        proc.kill()
    assert rc == 128 + signal.SIGTERM == 143, err  # exited with that code; not killed itself (-15)
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_a_signal_during_the_launchers_exit_does_not_lose_the_childs_exit_code(tmp_path: Path) -> None:
    # As when Slurm cancels a step whose rank has just failed: SIGTERM reaches every process of the
    # step, the launcher too, while it is exiting with the rank's code.
    rc, _, err = finish(launch(tmp_path, task_env(tmp_path, 1), "storm"))
    assert rc == 3, err


def test_sigusr1_reaches_a_child_that_handles_it(tmp_path: Path) -> None:
    proc = launch(tmp_path, task_env(tmp_path, 2), "usr1")
    try:
        wait_until(lambda: (tmp_path / "ready.json").exists(), 30, "the child's SIGUSR1 handler in place")
        proc.send_signal(signal.SIGUSR1)
        rc, out, err = finish(proc, 30)
    finally:
        proc.kill()
    assert rc == 10, err
    assert "trainguard launch: job llm rank 2 on n2 ready" in out


def test_rank0_trains_when_kafka_is_unreachable_and_says_so(tmp_path: Path) -> None:
    env = task_env(tmp_path, 0, TRAINGUARD__SIGNING__ENABLED="false")
    ready = tmp_path / "ready.json"
    # The child exits once the launcher is ready: after it has given up publishing.
    rc, out, err = finish(launch(tmp_path, env, "wait", "--ready-file", str(ready), "--publish-timeout", "3"))
    assert rc == 3, err
    assert json.loads((tmp_path / "seen.json").read_text())["RANK"] == "0"  # training ran meanwhile
    spec = json.loads(ready.read_text())["spec"]
    assert spec["state"] == "failed" and spec["attempts"] >= 1 and spec["failures"] == spec["attempts"]
    assert f"ERROR: job spec of llm NOT published after {spec['attempts']} attempt(s)" in err
    assert "job llm: Slurm job 4242 step 0, 4 ranks (tp2 pp1 dp2, 2 per node) on n1,n2, standbys n3" in err
    assert out.splitlines()[0] == "trainguard launch: job llm rank 0 on n1 ready"


def test_rank0_trains_without_a_signing_key_and_names_the_fix(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    rc, _, err = finish(launch(tmp_path, task_env(tmp_path, 0), "wait", "--ready-file", str(ready)))
    assert rc == 3, err
    spec = json.loads(ready.read_text())["spec"]
    assert spec["state"] == "failed" and spec["attempts"] == 1  # a missing key is not retried
    assert "launcher.key: run `trainguard keys init`" in spec["error"]
    assert "NOT published after 1 attempt(s)" in err


def test_a_missing_command_exits_127_and_bad_slurm_env_starts_nothing(tmp_path: Path) -> None:
    env = task_env(tmp_path, 1)
    res = subprocess.run(
        [TRAINGUARD, "launch", "--job", "llm", "--tp", "2", "--", "no-such-trainer"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 127 and "no-such-trainer: command not found" in res.stderr
    env["SLURM_TASKS_PER_NODE"] = "2(x3),1"
    res = subprocess.run(
        [TRAINGUARD, "launch", "--job", "llm", "--", sys.executable, "-c", "open('ran', 'w')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert res.returncode == 1 and "different task counts per node" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "ran").exists()


# -- what the launcher tells the node exporter ---------------------------------------------------------

#: the child: waits for the file argv[1], then, per argv[2]: "kill" SIGKILLs itself, "exit" exits 0.
ON_GO = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    go = pathlib.Path(sys.argv[1])
    while not go.exists():
        time.sleep(0.01)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    """
)
_ANCBUF = socket.CMSG_SPACE(12)  # one struct ucred


class ExporterSocket:
    """The exporter's end of the reporter socket, bound as its reporter source binds it: what
    arrives, decoded as the source decodes it, with the sender's kernel-verified credentials."""

    def __init__(self, path: Path) -> None:
        self.sock = bind_socket(path)
        self.poller = select.poll()  # not select(): a long test run holds descriptors past 1024
        self.poller.register(self.sock, select.POLLIN)
        self.got: list[tuple[Event, Peer]] = []

    def drain(self) -> list[tuple[Event, Peer]]:
        while self.sock.fileno() >= 0 and self.poller.poll(0):
            raw, anc, _, _ = self.sock.recvmsg(MAX_DATAGRAM, _ANCBUF)
            peer = peer_of(anc)
            assert peer is not None
            self.got += [(decode(part, local=True), peer) for part in raw.split(b"\n") if part]
        return self.got

    def of(self, cls: type) -> list[tuple[Any, Peer]]:
        return [(e, p) for e, p in self.drain() if isinstance(e, cls)]

    def close(self) -> None:
        """What came is kept (a launcher sends its last word before it exits)."""
        self.drain()
        self.sock.close()


def launch_on_go(tmp_path: Path, mode: str, *options: str) -> subprocess.Popen[str]:
    argv = [TRAINGUARD, "launch", "--job", "llm", "--tp", "2", "--reporter-socket", str(tmp_path / "r.sock")]
    argv += [*options, "--", sys.executable, "-c", ON_GO, str(tmp_path / "go"), mode]
    return subprocess.Popen(
        argv, env=task_env(tmp_path, 3), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_the_launcher_registers_its_rank_and_reports_its_sigkill(tmp_path: Path) -> None:
    exporter = ExporterSocket(tmp_path / "r.sock")
    proc = launch_on_go(tmp_path, "kill")
    try:
        reg, peer = wait_until(lambda: exporter.of(RankRegistration)[:1], 30, "the rank's registration")[0]
        assert peer.pid == proc.pid == reg.launcher_pid  # the kernel says who sent it
        assert (reg.job, reg.node, reg.rank, reg.local_rank) == ("llm", "n2", 3, 1)
        assert ProcTable().ppid(reg.pid) == proc.pid  # the pid registered is the launcher's child
        killed_after = now_ms()
        (tmp_path / "go").touch()
        rc, _, err = finish(proc, 30)
    finally:
        proc.kill()
        exporter.close()
    assert rc == 137, err
    ((e, peer),) = exporter.of(ProcessExit)
    assert peer.pid == proc.pid
    assert (e.job, e.node, e.rank, e.pid, e.role) == ("llm", "n2", 3, reg.pid, ProcessRole.MAIN)
    assert (e.exit_code, e.signal, e.reason) == (137, 9, "killed by signal 9 (SIGKILL), seen by its launcher")
    assert killed_after <= e.ts_ms <= now_ms()  # stamped when the rank died
    assert "not reachable" not in err


def test_an_exporter_started_after_the_launcher_learns_the_rank(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    proc = launch_on_go(tmp_path, "exit", "--register-interval", "0.5", "--ready-file", str(ready))
    exporter = None
    try:
        wait_until(ready.exists, 30, "the launcher ready")  # the training runs: nobody waited for us
        time.sleep(1.0)  # deliberately: the first registrations find no exporter
        exporter = ExporterSocket(tmp_path / "r.sock")
        regs = wait_until(lambda: exporter.of(RankRegistration), 10, "a registration once the exporter is up")
        assert {(r.pid, r.rank) for r, _ in regs} == {(json.loads(ready.read_text())["pid"], 3)}
        (tmp_path / "go").touch()
        rc, _, err = finish(proc, 30)
    finally:
        proc.kill()
        if exporter is not None:
            exporter.close()
    assert rc == 0, err
    ((e, _),) = exporter.of(ProcessExit)
    assert (e.exit_code, e.signal, e.reason) == (0, None, "exited with code 0, seen by its launcher")
    assert f"node exporter not reachable at {tmp_path / 'r.sock'}" in err
    assert "rank 3 registered with the node exporter" in err
