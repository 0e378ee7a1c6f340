"""The local executor on real demo processes: warm restarts, eviction onto a standby, stop.

A tp2 job on two one-rank machines (plus a standby machine) runs real gloo ranks; the executor
is driven the way the action service drives it, and everything is checked from the outside
(``/proc`` and the ranks' progress files), as an operator would.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from trainguard_demo.config import LaunchSpec
from trainguard_demo.executor import LocalConfig, LocalExecutor, _cmdline
from trainguard_demo.launcher import (
    launch_job,
    launch_standby,
    new_pool,
    read_progress,
    ready_pools,
    start_zygote,
    stop_job,
)
from trainguard_demo.zygote import zygote_pid

from tests.demo.helpers import make_spec, with_ranks
from tests.net import free_port, free_port_range
from tests.waiting import wait_until
from trainguard.actions.executors.base import ExecutorEnv, StepContext
from trainguard.schemas.control import JobSpec

pytestmark = pytest.mark.slow


def _ctx(step: str) -> StepContext:
    return StepContext(decision_id="d1", step=step, attempt=0, deadline=time.monotonic() + 120)


def _control_spec(demo: LaunchSpec) -> JobSpec:
    return JobSpec(job=demo.job, ts_ms=0, topology=demo.topology())


def _steps_past(demo: LaunchSpec, step: int, pids: set[int] | None = None) -> bool:
    prog = read_progress(demo)
    return len(prog) == demo.world_size and all(
        p.get("status") == "running" and p.get("step", 0) > step and (pids is None or p.get("pid") in pids)
        for p in prog.values()
    )


def _progress(what: str, demo: LaunchSpec) -> Callable[[], str]:
    return lambda: f"{what}; ranks' progress: {read_progress(demo)}"


# A cold start, two restarts and three generations of warm pools, each importing torch, on a
# shared 2-core host (about 20 s when idle): its own waits allow up to 510 s, so they, not the
# suite's 300 s default, say what was late.
@pytest.mark.timeout(600)
def test_warm_restart_eviction_and_stop(tmp_path: Path) -> None:
    demo = make_spec(tmp_path, free_port(), tp=2, pp=1, dp=1, machines=["m0", "m1"], steps=100_000)
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "t.json").write_text(demo.to_json())
    # Restart n rendezvouses on port_base + n % port_span: this test restarts twice.
    ports = 4
    ex = LocalExecutor(
        LocalConfig(
            cluster_dir=str(tmp_path),
            port_base=free_port_range(ports),
            port_span=ports,
            warm_delay_s=0.0,
            start_exporters=False,
        ),
        ExecutorEnv(state_dir=tmp_path / "executor"),
    )
    first = launch_job(demo)
    # m0 and m1 fork their pools from a zygote; the standby machine starts its pool cold.
    zygotes = [start_zygote(tmp_path, m) for m in ("m0", "m1")]
    wait_until(lambda: all(zygote_pid(tmp_path, m) for m in ("m0", "m1")), 30, "zygotes")
    pools = [launch_standby(tmp_path, "standby-0", 1)]
    for m in ("m0", "m1"):
        new_pool(tmp_path, m, 1)
    try:
        wait_until(lambda: _steps_past(demo, 3), 120, with_ranks("the cold-started job", first))
        wait_until(lambda: all(ready_pools(tmp_path, m, 1) for m in ("m0", "m1", "standby-0")), 120, "pools")
        cold = set(ex._ranks("t"))
        assert cold == {p.pid for p in first.procs}

        # A restart wakes the warm pools: new pids, the trainer's command line, resumed training.
        warm = {pid for m in ("m0", "m1") for pids in ex._spares(m).values() for pid in pids}
        assert len(warm) == 2
        ex.restart(_control_spec(demo), _ctx("restart"))
        wait_until(lambda: set(ex._ranks("t")) == warm, 30, "the woken pools found as the job's ranks")
        assert not cold & set(ex._ranks("t"))  # the old generation is gone
        # Woken processes take the trainer's command line (found by it from then on).
        wait_until(lambda: all("trainguard_demo.trainer" in _cmdline(p) for p in warm), 30, "renamed ranks")
        for pid in warm:
            argv = _cmdline(pid)
            assert "--rank" in argv and "--job" in argv and "--machine" in argv
        wait_until(lambda: _steps_past(demo, 5, warm), 60, _progress("steps of the woken ranks", demo))
        log = (tmp_path / "machines" / "m0" / "logs" / "standby").glob("*-slot-0.out")
        assert any("resumed at step" in f.read_text() for f in log)
        # ... and every machine gets a fresh pool for the next restart, forked by its zygote.
        wait_until(lambda: all(ready_pools(tmp_path, m, 1) for m in ("m0", "m1")), 30, "replenished pools")

        # Evict m1: its rank and its spare pool die; the standby machine takes its rank.
        spec = _control_spec(demo)
        ex.evict(spec, ["m1"], _ctx("evict"))
        # Evict kills the machine's processes with SIGKILL and does not wait for their exit
        # (nothing of the job runs there any more): they are gone moments later.
        wait_until(
            lambda: (
                not ex._ranks("t", {"m1"}) and not ex._spares("m1") and zygote_pid(tmp_path, "m1") is None
            ),
            10,
            "m1's rank, pool and zygote gone",  # the machine leaves with its zygote
        )
        assert (tmp_path / "machines" / "m1" / "EVICTED").exists()
        moved = demo.replace_machine("m1", "standby-0")
        ex.restart(_control_spec(moved), _ctx("restart-2"))
        persisted = LaunchSpec.from_json((tmp_path / "jobs" / "t.json").read_text())
        assert persisted.machine_names() == ["m0", "standby-0"]
        wait_until(
            lambda: _steps_past(persisted, 8), 90, _progress("steps on the standby machine", persisted)
        )
        assert ex._ranks("t", {"standby-0"})

        # Stop returns once SIGTERM is sent to ranks that take it by default (they run no more of
        # their code); their exits follow.
        ex.stop(spec, _ctx("stop"))
        wait_until(lambda: ex._ranks("t") == [], 10, "the stopped ranks gone")
    finally:
        for h in (first, *pools, *zygotes):
            stop_job(h, grace_s=0)
        for pids in (ex._spares(m) for m in ("m0", "m1", "standby-0")):
            for group in pids.values():
                ex._kill(group)
        ex._kill(ex._ranks("t"))


_GRACEFUL = (
    "import signal, sys, time\n"
    "def bye(*_):\n"
    "    time.sleep(0.3)  # a clean shutdown takes a moment\n"
    "    open(sys.argv[1], 'w').write('clean')\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, bye)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def _started(tmp_path: Path, code: str, *args: str) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, start_new_session=True)
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    return p


_PLAIN = "print('ready', flush=True); import time; time.sleep(60)"
_DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"


def _executor(tmp_path: Path, **options: object) -> LocalExecutor:
    return LocalExecutor(
        LocalConfig(cluster_dir=str(tmp_path), start_exporters=False, **options),  # type: ignore[arg-type]
        ExecutorEnv(state_dir=tmp_path / "executor"),
    )


def test_stop_waits_for_a_graceful_process_not_for_a_doomed_one(tmp_path: Path) -> None:
    """A rank with a SIGTERM handler gets its grace (its clean exit happens before _kill returns);
    one that takes SIGTERM by default is only signalled (it runs none of its code again)."""
    ex = _executor(tmp_path, stop_grace_s=10.0)
    graceful = _started(tmp_path, _GRACEFUL, str(tmp_path / "clean"))
    plain = _started(tmp_path, _PLAIN)
    try:
        ex._kill([graceful.pid, plain.pid])
        assert (tmp_path / "clean").read_text() == "clean"  # waited for, within its grace
        assert graceful.wait(5) == 0
        assert plain.wait(5) == -signal.SIGTERM  # signalled, and it went
    finally:
        for p in (graceful, plain):
            p.kill()
            p.wait()


def test_final_sigterm_is_not_waited_for_and_a_deaf_process_is_killed_after_the_grace(tmp_path: Path) -> None:
    """sigterm_is_final (the demo: the ranks' handler only reports the exit): _kill returns before
    the handler is done, the handler still finishes its exit; a process that ignores SIGTERM is
    SIGKILLed by the background timer once the grace is over."""
    ex = _executor(tmp_path, stop_grace_s=1.0, sigterm_is_final=True)
    graceful = _started(tmp_path, _GRACEFUL, str(tmp_path / "clean"))
    deaf = _started(tmp_path, _DEAF)
    try:
        ex._kill([graceful.pid, deaf.pid])
        assert not (tmp_path / "clean").exists()  # not waited for: its handler sleeps 0.3 s first
        assert graceful.wait(10) == 0 and (tmp_path / "clean").read_text() == "clean"
        assert deaf.wait(10) == -signal.SIGKILL  # the grace passed: killed in the background
    finally:
        for p in (graceful, deaf):
            p.kill()
            p.wait()


def test_evict_stops_the_evicted_machines_node_exporter(tmp_path: Path) -> None:
    """An evicted machine leaves with its node agent; the other machines' agents stay."""
    ex = _executor(tmp_path)

    def agent(machine: str) -> subprocess.Popen[bytes]:
        state = tmp_path / "machines" / machine / "exporter"
        code = "print('ready', flush=True); import time; time.sleep(60)"
        return _started(tmp_path, code, "demo-exporter", "--node", machine, "--state-dir", str(state))

    stays, goes = agent("m0"), agent("m1")
    spec = make_spec(tmp_path, free_port(), tp=2, pp=1, dp=1, ranks_per_machine=1, machines=["m0", "m1"])
    try:
        ex.evict(_control_spec(spec), ["m1"], _ctx("evict"))
        assert goes.wait(10) == -signal.SIGTERM
        assert stays.poll() is None
        assert (tmp_path / "machines" / "m1" / "EVICTED").exists()
    finally:
        for p in (stays, goes):
            p.kill()
            p.wait()
