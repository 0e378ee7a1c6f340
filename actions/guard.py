"""Safety limits: the blast-radius guard on evictions and the restart budget.

Both read the durable logs of the progress store, so they hold across service restarts.  A limit
that would be exceeded *holds* the recovery for an operator (``trainguard actions release``)
rather than failing it: a burst of evictions is more often a detector or network problem than
many bad machines, and a job that crashes on every restart is live-locked, not recovering.
"""

from __future__ import annotations

from trainguard.actions.config import ActionsConfig
from trainguard.actions.progress import ProgressStore

HOUR_MS = 3600 * 1000


def eviction_hold(
    cfg: ActionsConfig, store: ProgressStore, decision_id: str, job: str, machines: list[str], now_ms: int
) -> str:
    """Why evicting ``machines`` of ``job`` now must wait for an operator ("" when it may go).

    Checked and recorded atomically (:meth:`ProgressStore.reserve_evictions`): recoveries of
    several jobs checking at once cannot all pass a cap that only one of them fits under."""

    def refuse(per_job: int, total: int) -> str:
        if per_job > cfg.max_evictions_per_job_hour:
            return (
                f"blast radius: evicting {len(machines)} machine(s) would make {per_job} evictions of job "
                f"{job} in the last hour (cap {cfg.max_evictions_per_job_hour})"
            )
        if total > cfg.max_evictions_per_hour:
            return (
                f"blast radius: evicting {len(machines)} machine(s) would make {total} evictions in the "
                f"last hour across all jobs (cap {cfg.max_evictions_per_hour})"
            )
        return ""

    return store.reserve_evictions(decision_id, job, machines, now_ms - HOUR_MS, now_ms, refuse)


def restart_hold(cfg: ActionsConfig, store: ProgressStore, job: str, now_ms: int) -> str:
    """Why restarting ``job`` again must wait for an operator ("" when the budget allows it)."""
    done = store.restarts_since(job, now_ms - int(cfg.restart_window_s * 1000))
    if done >= cfg.max_restarts:
        return (
            f"restart budget: job {job} was restarted {done} times in the last "
            f"{cfg.restart_window_s:g} s (budget {cfg.max_restarts}); it looks live-locked"
        )
    return ""
