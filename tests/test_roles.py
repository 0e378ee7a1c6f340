"""Each service role runs with only its own extras installed: no torch, no NVML, no demo anywhere.

- the stream worker (``pip install "trainguard[worker,store]"``): no plotly, no Kubernetes client;
- the action service (``pip install "trainguard[actions]"``): none of the worker's Faust, aiokafka,
  numpy or scikit-learn, no ClickHouse client, no plotly.

The development virtualenv has everything installed, so each process here starts behind an
import blocker (a meta-path finder that refuses the modules its role does not install), exactly as
if those distributions were absent.  The worker must become healthy and the action service must
start consuming, against the real local stack.  (The training side's closure, standard library
only, is checked in ``tests/trainguard/test_import_root.py``.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.net import free_port
from tests.waiting import wait_until

#: what no service role installs.
ABSENT = ("torch", "setproctitle", "pynvml", "trainguard_demo")
#: and what each role does not install beyond that.
WORKER_ABSENT = (*ABSENT, "plotly", "kubernetes")
ACTIONS_ABSENT = (*ABSENT, "plotly", "faust", "mode", "aiokafka", "numpy", "sklearn", "clickhouse_connect")

BLOCKER = """
import importlib.abc, sys
ABSENT = {absent!r}
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: not in this role's install)", name=name)
        return None
sys.meta_path.insert(0, _Absent())
sys.argv[0] = "trainguard"
from trainguard.cli import main
main()
"""


def _start(
    args: list[str], log: Path, env: dict[str, str], absent: tuple[str, ...]
) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-c", BLOCKER.format(absent=absent), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_blocker_blocks() -> None:
    """The blocker really hides torch (otherwise the tests below prove nothing)."""
    for module in ("torch", "faust"):
        code = BLOCKER.format(absent=ACTIONS_ABSENT).replace(
            "from trainguard.cli import main\nmain()", f"import {module}"
        )
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert res.returncode != 0 and "blocked: not in this role's install" in res.stderr


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_worker_and_action_service_run_with_their_role_installs_only(tmp_path: Path) -> None:
    port = free_port()
    worker_log, actions_log = tmp_path / "worker.log", tmp_path / "actions.log"
    worker = _start(
        ["worker", "--app-id", f"tg-role-{uuid.uuid4().hex[:8]}", "--web-port", str(port)],
        worker_log,
        {"TRAINGUARD__WORKER__AUTO_OFFSET_RESET": "latest"},
        WORKER_ABSENT,
    )
    actions = _start(
        ["actions"],
        actions_log,
        {
            "TRAINGUARD__ACTIONS__EXECUTOR": "dry_run",
            "TRAINGUARD__ACTIONS__STATE_DIR": str(tmp_path / "actions"),
            "TRAINGUARD__ACTIONS__GROUP_ID": f"tg-role-{uuid.uuid4().hex[:8]}",
            "TRAINGUARD__ACTIONS__JOBS": "[role-test-job]",
        },
        ACTIONS_ABSENT,
    )
    try:
        wait_until(
            lambda: _healthy(port) or worker.poll() is not None,
            180,
            lambda: f"worker healthy on :{port}; log:\n{worker_log.read_text()[-3000:]}",
        )
        assert worker.poll() is None, worker_log.read_text()[-3000:]
        wait_until(
            lambda: "action service up" in actions_log.read_text() or actions.poll() is not None,
            120,
            lambda: f"action service up; log:\n{actions_log.read_text()[-3000:]}",
        )
        assert actions.poll() is None, actions_log.read_text()[-3000:]
        assert (tmp_path / "actions" / "progress.sqlite").exists()
    finally:
        _stop(worker)
        _stop(actions)
    for log in (worker_log, actions_log):
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
