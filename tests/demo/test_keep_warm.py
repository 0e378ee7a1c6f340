"""Warm processes stay warm while they wait: a pool slot exercises a rank's first-use paths, and
the local executor runs a throwaway round of the stop-time tests, every ``keep_warm`` seconds
(on a host that pages out memory idle for a minute, the first use after a quiet spell otherwise
reads torch's code back from disk while the job is stopped)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import trainguard_demo.executor as executor_module
from trainguard_demo.config import write_atomic
from trainguard_demo.executor import LocalConfig, LocalExecutor
from trainguard_demo.standby import StandbyConfig, wait_for_activation

from actions.executors.base import ExecutorEnv, StepContext
from schemas.control import JobSpec
from schemas.topology import JobTopology
from tests.demo.helpers import make_spec
from tests.waiting import wait_until


def test_a_waiting_slot_exercises_itself_until_it_is_woken(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, 29999, tp=1, pp=1, dp=1, ranks_per_machine=1, machines=["s0"])
    cfg = StandbyConfig(str(tmp_path), "s0", 0, pool="p", poll_s=0.01, keep_warm_s=0.05)
    calls: list[float] = []
    threading.Timer(0.4, lambda: write_atomic(spec.paths().activation("s0", "p"), spec.to_json())).start()
    woken, rank = wait_for_activation(cfg, lambda: calls.append(time.monotonic()))
    assert woken.job == spec.job and rank == 0
    assert 3 <= len(calls) <= 9  # every 50 ms of the 400 ms wait, give or take the host


def test_a_slot_that_is_not_to_be_kept_warm_only_waits(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, 29999, tp=1, pp=1, dp=1, ranks_per_machine=1, machines=["s0"])
    cfg = StandbyConfig(str(tmp_path), "s0", 0, pool="p", poll_s=0.01, keep_warm_s=0)
    threading.Timer(0.2, lambda: write_atomic(spec.paths().activation("s0", "p"), spec.to_json())).start()
    called: list[int] = []
    wait_for_activation(cfg, lambda: called.append(1))
    assert called == []


def test_the_executor_keeps_the_stop_time_tests_warm_but_never_beside_a_diagnosis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds: list[list[str]] = []
    diagnosing = threading.Event()

    def fake_run_local(machines: list[str], tests: object, *args: object, **kw: object) -> list[object]:
        if machines[0].startswith("prewarm"):
            assert not diagnosing.is_set(), "a keep-warm round ran beside a diagnosis"
        else:
            diagnosing.set()
            time.sleep(0.3)
            diagnosing.clear()
        rounds.append(list(machines))
        return []

    monkeypatch.setattr(executor_module, "prewarm", lambda: True)
    monkeypatch.setattr(executor_module, "run_local", fake_run_local)
    ex = LocalExecutor(
        LocalConfig(cluster_dir=str(tmp_path), diagnostics_keep_warm_s=0.05, start_exporters=False),
        ExecutorEnv(state_dir=tmp_path / "executor"),
    )
    ex.prepare()
    wait_until(lambda: len(rounds) >= 4, 10, "keep-warm rounds")
    spec = JobSpec(
        job="t", ts_ms=0, topology=JobTopology(job="t", ranks_per_machine=1, dp=2, machines=["m0", "m1"])
    )
    ctx = StepContext(decision_id="d", step="diagnose", attempt=0, deadline=time.monotonic() + 30)
    ex.run_diagnostics(spec, ["m0", "m1"], ["alignment"], ctx)
    wait_until(lambda: rounds[-1][0].startswith("prewarm"), 10, "keep-warm rounds after the diagnosis")
    ex.close()
    time.sleep(0.2)
    settled = len(rounds)
    time.sleep(0.3)
    assert len(rounds) == settled  # closed: no more rounds
