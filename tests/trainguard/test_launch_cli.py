"""``trainguard launch`` as a process, with a Slurm task's environment set by hand (no Slurm, no Kafka).

The training command is a tiny Python child; the tests check what it saw, the launcher's exit code
(the child's, or 128 + the signal that killed it), signal forwarding, readiness, and that rank 0
runs the training when the job spec cannot be published (Kafka away, no signing key).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.net import free_port
from tests.waiting import wait_until

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
