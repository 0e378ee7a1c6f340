"""The real stop-time tests: torch alignment step and gloo all-gather between local processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from trainguard_demo.diagnostics import LocalFaults, alignment_digest, prewarm, ring_pairs, run_local
from trainguard_demo.diagnostics import server as diagnostics
from trainguard_demo.executor import LocalConfig, LocalExecutor

from tests.net import free_port
from tests.waiting import wait_until
from trainguard.actions.executors.base import ExecutorEnv, StepContext
from trainguard.schemas.control import JobSpec
from trainguard.schemas.topology import JobTopology


def test_alignment_digest_is_bitwise_reproducible_and_sensitive() -> None:
    assert alignment_digest() == alignment_digest()
    assert alignment_digest(perturb=True) != alignment_digest()


def test_ring_pairs() -> None:
    assert ring_pairs(1) == [] and ring_pairs(2) == [(0, 1)]
    assert ring_pairs(3) == [(0, 1), (1, 2), (2, 0)]


@pytest.fixture
def warm() -> None:
    """The test server up before the timed part, as the action service has it (its cold start --
    importing torch -- can outlast a test's timeout on a loaded two-core host)."""
    assert prewarm()


@pytest.mark.slow
@pytest.mark.usefixtures("warm")
def test_three_machines_find_the_odd_one_out_in_each_test() -> None:
    machines = ["m0", "m1", "m2"]
    faults = LocalFaults(perturb=frozenset({"m1"}), corrupt=frozenset({"m2"}))
    results = run_local(machines, ["alignment", "connectivity"], faults, timeout_s=20)
    failed = {(r.test, r.machine) for r in results if not r.passed}
    assert failed == {("alignment", "m1"), ("connectivity", "m2")}
    assert len(results) == 6


@pytest.mark.slow
@pytest.mark.usefixtures("warm")
def test_unreachable_machine_fails_connectivity_and_two_machines_cannot_outvote() -> None:
    three = run_local(["a", "b", "c"], ["connectivity"], LocalFaults(absent=frozenset({"c"})), timeout_s=4)
    assert {r.machine for r in three if not r.passed} == {"c"}
    two = run_local(["a", "b"], ["alignment"], LocalFaults(perturb=frozenset({"b"})))
    assert all(not r.passed and "no majority" in r.detail for r in two)


# --- the test server: each test forked from a process that already imported torch ----------------


def _stuck_connectivity() -> dict[str, object]:
    """A rank whose peer never comes: it waits in the gloo rendezvous until killed."""
    return {"rank": 0, "world": 2, "port": free_port(), "timeout_s": 120.0}


@pytest.mark.slow
@pytest.mark.usefixtures("warm")
def test_repeated_runs_fork_fresh_processes_from_the_warm_server_and_agree_bit_for_bit() -> None:
    server = diagnostics._get_server()
    faults = LocalFaults(perturb=frozenset({"m1"}))
    first = run_local(["m0", "m1", "m2"], ["alignment"], faults, timeout_s=20)
    second = run_local(["m0", "m1", "m2"], ["alignment"], faults, timeout_s=20)
    assert diagnostics._get_server() is server  # served by the same, prewarmed server
    for results in (first, second):
        assert [(r.machine, r.passed) for r in results] == [("m0", True), ("m1", False), ("m2", True)]
    assert [r.detail for r in first] == [r.detail for r in second]
    # the digests are those of a step in this very process, and each test ran in its own process
    answers = diagnostics.run_tests([("alignment", {"perturb": p}) for p in (False, False, True)], 20)
    assert [a["digest"] for a in answers] == [alignment_digest()] * 2 + [alignment_digest(perturb=True)]
    pids = {a["pid"] for a in answers}
    assert len(pids) == 3 and not pids & {os.getpid(), server.proc.pid}


@pytest.mark.slow
@pytest.mark.usefixtures("warm")
def test_a_killed_test_fails_and_a_stuck_one_is_killed_at_the_timeout() -> None:
    server = diagnostics._get_server()
    job = server.submit("connectivity", _stuck_connectivity())
    wait_until(lambda: job.pid is not None, 60, "the server to fork the connectivity test", interval_s=0.05)
    assert job.pid is not None
    os.kill(job.pid, signal.SIGKILL)
    assert job.done.wait(30)
    assert job.answer() == {"ok": False, "detail": "exit -9 (SIGKILL) without an answer"}

    (answer,) = diagnostics.run_tests([("connectivity", _stuck_connectivity())], timeout_s=1)
    assert answer == {"ok": False, "detail": "no answer within 1 s"}
    assert not server.jobs and server.alive()  # the stuck child was killed and reaped
    assert all(r.passed for r in run_local(["a", "b"], ["connectivity"], timeout_s=20))


@pytest.mark.slow
def test_a_dead_server_fails_what_it_was_running_and_is_replaced() -> None:
    server = diagnostics._get_server()
    job = server.submit("connectivity", _stuck_connectivity())
    server.proc.kill()
    assert job.done.wait(30)
    assert not job.answer()["ok"] and "diagnostics server exited" in str(job.answer()["detail"])
    assert prewarm() and diagnostics._get_server() is not server  # a new one replaced it
    results = run_local(["a", "b", "c"], ["alignment"], LocalFaults(perturb=frozenset({"b"})), timeout_s=20)
    assert {r.machine for r in results if not r.passed} == {"b"}


@pytest.mark.slow
def test_the_local_executor_prepares_the_stop_time_tests(tmp_path: Path) -> None:
    """prepare() starts the test server and runs one throwaway round of every test (so the first
    real diagnosis is not the one paying for the children's first use of torch); a diagnosis of
    the job's machines then works as usual."""
    ex = LocalExecutor(
        LocalConfig(cluster_dir=str(tmp_path), start_exporters=False), ExecutorEnv(state_dir=tmp_path / "ex")
    )
    ex.prepare()
    results = ex.run_diagnostics(
        JobSpec(job="t", ts_ms=0, topology=JobTopology(job="t")),
        ["m0", "m1"],
        list(ex.diagnostic_tests),
        StepContext(decision_id="d1", step="diagnose", attempt=0, deadline=time.monotonic() + 60),
    )
    assert {(r.machine, r.test) for r in results} == {
        (m, t) for m in ("m0", "m1") for t in ex.diagnostic_tests
    }
    assert all(r.passed for r in results), results
