"""The action service: consumes decisions and drives one recovery at a time per job.

Main loop (one thread):

1. poll the decisions topic (consumer group ``cfg.group_id``) and *accept* each decision into the
   progress store (idempotent by ``decision_id``: a redelivered decision is a no-op), then commit
   the offsets -- a decision is committed only once it is durably recorded, and from then on the
   store, not Kafka, carries it (a recovery can take minutes; Kafka's poll interval must not);
2. follow the jobs topic (from the beginning, no group) so the latest JobSpec per job is known;
3. turn overdue lazy code updates into forced ones (§6.1: at most ``lazy_update_max_wait_s``);
4. start a worker thread for every job whose queue head is runnable.

Per-job serialization: a job's recoveries run in acceptance order, one at a time, each on the
job's worker thread.  A decision for a job that is recovering is **queued**; when its turn comes
it is **merged** (state ``superseded``) if the recovery that was running when it arrived already
covered it: a crash/NaN report (diagnose) or a plain restart arriving while a recovery stopped
and restarted the job, or an eviction whose machines are no longer in the job.  Everything else
(evictions of other machines, rollbacks, code updates) runs after it.  A *held* recovery blocks
its job's queue until an operator releases or cancels it.

On start the service resumes every unfinished recovery from the store, so killing it mid-recovery
and restarting it completes that recovery once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actions.config import ActionsConfig
from actions.executors import ExecutorEnv, create_executor
from actions.executors.base import Executor
from actions.plans import CodeUpdate
from actions.progress import ProgressStore
from actions.recovery import RecoveryRunner
from actions.state import RecoveryState
from infra.bus import EventConsumer, EventProducer
from infra.config import Settings
from schemas.base import now_ms
from schemas.codec import DecodeError, decode
from schemas.control import ActionEvent, Decision, JobSpec, stable_id
from schemas.topics import ACTIONS, DECISIONS, JOBS

log = logging.getLogger(__name__)


def state_dir(settings: Settings, cfg: ActionsConfig) -> Path:
    return (
        Path(cfg.state_dir).expanduser().resolve() if cfg.state_dir else settings.stack.home_path / "actions"
    )


def open_store(settings: Settings, cfg: ActionsConfig) -> ProgressStore:
    return ProgressStore(state_dir(settings, cfg) / "progress.sqlite")


class KafkaPublisher:
    """Action events to the actions topic, job specs to the jobs topic, each acknowledged."""

    def __init__(self, producer: EventProducer, timeout_s: float = 15.0) -> None:
        self.producer, self.timeout_s = producer, timeout_s

    def action(self, event: ActionEvent) -> None:
        self.producer.send(event, ACTIONS).get(timeout=self.timeout_s)

    def job_spec(self, spec: JobSpec) -> None:
        self.producer.send(spec, JOBS).get(timeout=self.timeout_s)

    def decision(self, decision: Decision) -> None:
        self.producer.send(decision, DECISIONS).get(timeout=self.timeout_s)


class JobsFollower:
    """Reads the whole jobs topic, then keeps following it (no consumer group: every service
    instance needs every spec)."""

    def __init__(self, settings: Settings, store: ProgressStore, wanted: Callable[[str], bool]) -> None:
        from kafka import KafkaConsumer, TopicPartition

        self.store, self.wanted = store, wanted
        self.consumer = KafkaConsumer(
            **settings.kafka.client_kwargs(), group_id=None, enable_auto_commit=False
        )
        parts = [TopicPartition(JOBS.name, p) for p in range(JOBS.partitions)]
        self.consumer.assign(parts)
        self.consumer.seek_to_beginning(*parts)

    def poll(self, timeout_ms: int = 0) -> int:
        seen = 0
        for recs in self.consumer.poll(timeout_ms=timeout_ms, max_records=5000).values():
            for r in recs:
                try:
                    spec = decode(r.value, expect=JobSpec)
                except DecodeError:
                    continue  # the workers' sink dead-letters garbage on this topic
                if isinstance(spec, JobSpec) and self.wanted(spec.job):
                    self.store.save_spec(spec)
                    seen += 1
        return seen

    def close(self) -> None:
        self.consumer.close()


class ActionService:
    """Consumer loop + per-job workers; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        cfg: ActionsConfig,
        executor: Executor | None = None,
        clock: Callable[[], int] = now_ms,
    ) -> None:
        self.settings, self.cfg, self.clock = settings, cfg, clock
        self.dir = state_dir(settings, cfg)
        self.store = ProgressStore(self.dir / "progress.sqlite")
        env = ExecutorEnv(state_dir=self.dir / "executor", kafka_bootstrap=settings.kafka.bootstrap_servers)
        self.executor = executor or create_executor(cfg.executor, cfg.executor_options, env)
        self.producer = EventProducer(settings.kafka, linger_ms=0)
        self.publisher = KafkaPublisher(self.producer)
        self.stop_event = threading.Event()
        self.runner = RecoveryRunner(
            cfg, self.store, self.executor, self.publisher, self.store.spec, self.stop_event, clock
        )
        self._workers: dict[str, threading.Thread] = {}
        # Warm-up (e.g. a torch-preloading diagnostics server) off the main loop, before any recovery.
        threading.Thread(target=self.executor.prepare, name="executor-prepare", daemon=True).start()
        self._consumer: EventConsumer | None = None
        self._jobs: JobsFollower | None = None
        self.accepted = 0
        self.redelivered = 0

    def wanted(self, job: str) -> bool:
        return not self.cfg.jobs or job in self.cfg.jobs

    # --- loop ------------------------------------------------------------------------------------

    def start_consuming(self) -> None:
        self._consumer = EventConsumer(
            self.settings.kafka,
            [DECISIONS.name],
            self.cfg.group_id,
            producer=self.producer,
            session_timeout_ms=10_000,
            max_poll_records=500,
        )
        self._jobs = JobsFollower(self.settings, self.store, self.wanted)

    def run(self, stop: threading.Event | None = None) -> None:
        """Run until ``stop`` (or :meth:`shutdown`) is set."""
        if self._consumer is None:
            self.start_consuming()
        stop = stop or self.stop_event
        try:
            while not stop.is_set() and not self.stop_event.is_set():
                self.tick(int(self.cfg.poll_interval_s * 1000))
        finally:
            self.shutdown()

    def tick(self, timeout_ms: int) -> None:
        """One round of the main loop (public so tests and embedders can drive it)."""
        assert self._consumer is not None and self._jobs is not None
        self._jobs.poll(0)
        batch = self._consumer.poll(timeout_ms=timeout_ms)
        for ev in batch.events:
            if isinstance(ev, Decision) and self.wanted(ev.job):
                self.accept(ev)
        if batch.events or batch.dead_letters:
            self._consumer.commit()  # after every decision of the batch is in the store
        self._jobs.poll(0)
        self.force_overdue_updates()
        self.dispatch()

    def accept(self, decision: Decision) -> bool:
        if self.store.accept(decision, self.clock()):
            self.accepted += 1
            log.info(
                "accepted decision %s (%s) for job %s", decision.decision_id, decision.action, decision.job
            )
            return True
        self.redelivered += 1
        return False

    def force_overdue_updates(self) -> None:
        limit_ms = int(self.cfg.lazy_update_max_wait_s * 1000)
        now = self.clock()
        for ch in self.store.pending_updates():
            if not self.wanted(ch.job) or now - ch.requested_ms < limit_ms:
                continue
            forced = CodeUpdate(ch.version, urgent=True, forced=True).decision(
                ch.job,
                stable_id("forced-update", ch.decision_id, ch.version),
                now,
                reason=f"lazy update {ch.version} waited {self.cfg.lazy_update_max_wait_s:g} s: forced",
            )
            if self.accept(forced):
                try:  # recorded next to the workers' decisions (and so in ClickHouse)
                    self.publisher.decision(forced)
                except Exception as exc:
                    log.warning("could not publish forced update decision: %s", exc)

    def dispatch(self) -> None:
        for job in self.store.jobs_with_work():
            t = self._workers.get(job)
            if t is not None and t.is_alive():
                continue
            t = threading.Thread(target=self._work, args=(job,), name=f"recover-{job}", daemon=True)
            self._workers[job] = t
            t.start()

    def _work(self, job: str) -> None:
        while not self.stop_event.is_set():
            head = self.store.head_of_job(job)
            if head is None or head.state is RecoveryState.HELD:
                return
            try:
                rec = self.runner.run(head.decision_id)
            except Exception:  # a bug or a broken store: log it, retry at a later dispatch
                log.exception("recovery %s of job %s crashed", head.decision_id, job)
                self.stop_event.wait(1.0)
                return
            if not rec.state.terminal:
                return  # held, or stopping

    def idle(self) -> bool:
        """No worker is running (tests wait for this)."""
        return not any(t.is_alive() for t in self._workers.values())

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self.stop_event.set()
        for t in self._workers.values():
            t.join(timeout_s)
        for closer in (self._consumer, self._jobs):
            if closer is not None:
                try:
                    closer.close()
                except Exception as exc:  # closing is best effort
                    log.debug("close failed: %s", exc)
        self._consumer = self._jobs = None
        self.executor.close()
        try:
            self.producer.close()
        except Exception as exc:
            log.debug("producer close failed: %s", exc)
        self.store.close()


def status(store: ProgressStore, job: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
    """Recent recoveries with their steps, for ``trainguard actions status``."""
    out = []
    for r in store.recoveries(job, limit):
        out.append(
            {
                "decision_id": r.decision_id,
                "job": r.job,
                "action": r.decision.action.value,
                "state": r.state.value,
                "path": r.path,
                "accepted_ms": r.accepted_ms,
                "started_ms": r.started_ms,
                "finished_ms": r.finished_ms,
                "held_reason": r.held_reason,
                "detail": r.detail,
                "steps": [
                    {k: s[k] for k in ("key", "status", "attempts", "started_ms", "finished_ms")}
                    for s in store.steps(r.decision_id)
                ],
            }
        )
    return out
