"""The durable progress store and the safety limits on it (SQLite files, no servers)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from trainguard.actions import guard
from trainguard.actions.config import ActionsConfig
from trainguard.actions.progress import ProgressStore
from trainguard.actions.state import InvalidStateTransition, RecoveryState
from trainguard.schemas.control import Decision, Targets
from trainguard.schemas.enums import Action


def dec(i: str, job: str = "j", action: Action = Action.EVICT) -> Decision:
    return Decision(decision_id=i, ts_ms=1, job=job, action=action, targets=Targets(machines=["n1"]))


def test_accept_is_idempotent_and_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "p.sqlite"
    store = ProgressStore(path)
    assert store.accept(dec("a"), 10) and not store.accept(dec("a"), 11)
    store.accept(dec("b"), 12)
    store.transition("a", RecoveryState.STOPPING, started_ms=13)
    store.step_started("a", "stop", 13)
    store.step_done("a", "stop", {"x": 1}, 14, job="j")
    store.step_started("a", "evict", 15)  # in flight when the process dies
    store.close()

    again = ProgressStore(path)
    assert again.head_of_job("j").decision_id == "a"  # type: ignore[union-attr]
    assert again.step_results("a") == {"stop": {"x": 1}}
    assert [s["status"] for s in again.steps("a")] == ["done", "running"]
    assert again.step_started("a", "evict", 16) == 2
    with pytest.raises(InvalidStateTransition):
        again.transition("a", RecoveryState.REPLENISHING)
    assert [r.decision_id for r in again.recoveries("j")] == ["a", "b"]


def test_guard_counts_evictions_per_job_and_overall(tmp_path: Path) -> None:
    store = ProgressStore(tmp_path / "p.sqlite")
    cfg = ActionsConfig(max_evictions_per_job_hour=3, max_evictions_per_hour=4)
    now = 10 * guard.HOUR_MS
    store.step_done("d1", "evict", {}, now - 100, job="a", evicted=["n1", "n2"])
    store.step_done("d1", "evict", {}, now - 50, job="a", evicted=["n1", "n2"])  # re-recorded: counted once
    store.step_done("old", "evict", {}, now - guard.HOUR_MS - 1, job="a", evicted=["n9"])
    assert "job a" in guard.eviction_hold(cfg, store, "d3", "a", ["n3", "n4"], now)  # 4 > 3
    assert guard.eviction_hold(cfg, store, "d3", "a", ["n3"], now) == ""  # 3: passes, and is logged
    assert guard.eviction_hold(cfg, store, "d3", "a", ["n3"], now) == ""  # resumed: its own rows pass
    assert "job a" in guard.eviction_hold(cfg, store, "d4", "a", ["n5"], now)  # n3 counts, in flight
    store.step_done("d3", "evict", {}, now + 5, job="a", evicted=["n3"])  # the step: counted once
    assert store.evictions_since(now - guard.HOUR_MS, "a") == 3
    store.step_done("d2", "evict", {}, now - 10, job="b", evicted=["m1"])
    assert "across all jobs" in guard.eviction_hold(cfg, store, "d5", "b", ["m3"], now)  # 5 > 4


def test_the_guard_checks_and_records_atomically_across_concurrent_recoveries(tmp_path: Path) -> None:
    """Recoveries of many jobs reaching their evict step at once: exactly the cap gets through."""
    store = ProgressStore(tmp_path / "p.sqlite")
    cfg = ActionsConfig(max_evictions_per_hour=5)
    now = 10 * guard.HOUR_MS
    start = threading.Barrier(20)
    results: dict[int, str] = {}

    def recover(i: int) -> None:
        start.wait()
        results[i] = guard.eviction_hold(cfg, store, f"d{i}", f"job{i}", [f"m{i}"], now)

    threads = [threading.Thread(target=recover, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(1 for reason in results.values() if reason == "") == 5
    assert store.evictions_since(now - guard.HOUR_MS) == 5


def test_a_pause_is_persisted_until_resumed(tmp_path: Path) -> None:
    path = tmp_path / "p.sqlite"
    store = ProgressStore(path)
    assert store.paused() is None and not store.resume()
    store.pause("network maintenance", "alice", 123)
    store.close()
    again = ProgressStore(path)
    assert again.paused() == {"reason": "network maintenance", "by": "alice", "ts_ms": 123}
    assert again.resume() and again.paused() is None


def test_restart_budget(tmp_path: Path) -> None:
    store = ProgressStore(tmp_path / "p.sqlite")
    cfg = ActionsConfig(max_restarts=2, restart_window_s=60)
    for i in range(2):
        store.step_done(f"r{i}", "restart", {}, 1_000 + i, job="j", restarted=True)
    assert "live-locked" in guard.restart_hold(cfg, store, "j", 2_000)
    assert guard.restart_hold(cfg, store, "j", 1_000 + 61_000) == ""


def test_code_versions_stack_rollbacks_and_lazy_updates(tmp_path: Path) -> None:
    store = ProgressStore(tmp_path / "p.sqlite")
    store.request_update("j", "v2", "u1", 10, previous="v1")
    store.request_update("j", "v3", "u2", 11)
    store.request_update("j", "v3", "u2", 12)  # redelivered request: one row
    assert [c.version for c in store.pending_updates("j")] == ["v2", "v3"]
    assert store.version_stack("j") == ["v1"]
    store.step_done("r", "hot_update", {}, 20, job="j", code_applied=("v3", "update", "lazy update"))
    assert store.pending_updates("j") == []
    assert [(c.version, c.status) for c in store.code_changes("j")][:3] == [
        ("v1", "applied"),
        ("v2", "superseded"),
        ("v3", "applied"),
    ]
    assert store.version_stack("j") == ["v1", "v3"]
    store.step_done("r2", "hot_update", {}, 30, job="j", code_applied=("v1", "rollback", "rollback"))
    assert store.version_stack("j") == ["v1"]


def test_release_returns_to_the_held_step(tmp_path: Path) -> None:
    store = ProgressStore(tmp_path / "p.sqlite")
    store.accept(dec("h"), 1)
    store.transition("h", RecoveryState.STOPPING)
    store.transition("h", RecoveryState.EVICTING)
    store.transition("h", RecoveryState.HELD, held_reason="cap", held_step="evict")
    assert store.jobs_with_work() == []  # a held head blocks the job
    rec = store.release("h")
    assert rec.state is RecoveryState.EVICTING and rec.released == ["evict"]
    assert store.jobs_with_work() == ["j"]
    with pytest.raises(ValueError, match="not held"):
        store.release("h")
