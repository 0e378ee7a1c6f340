"""The action service: consumes decisions and drives one recovery at a time per job.

Main loop (one thread):

1. poll the decisions topic (consumer group ``cfg.consumer_group``) and *accept* each decision into the
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

Bad records never stop the service.  Each consumed decision and job spec is handled in its own
``try``: one that cannot be decoded, or decodes but fails when it is handled (a string the store
cannot encode, say), is dead-lettered (stage ``actions:accept`` / ``actions:jobs``; logged once at
ERROR with its coordinates, counted in :attr:`ActionService.dead_lettered`) and the service
commits past it.  A recovery whose run keeps crashing (a bug in planning, an impossible state) is
failed after :data:`MAX_RECOVERY_CRASHES` tries and dead-lettered (``actions:recover``), so its
job's queue moves on.  The world being down is not the record's fault: a broker or a disk away
(:func:`transient`) is retried with :class:`trainguard.infra.backoff.Backoff`, the records seeked back to and
read again, nothing committed past them.

Metrics (:mod:`trainguard.actions.metrics`) are served on ``metrics_host:metrics_port`` while
:meth:`run` runs.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

from trainguard.actions.config import ActionsConfig
from trainguard.actions.executors import ExecutorEnv, create_executor
from trainguard.actions.executors.base import Executor
from trainguard.actions.metrics import REJECT_REASONS, ActionMetrics
from trainguard.actions.plans import CodeUpdate
from trainguard.actions.progress import ProgressStore
from trainguard.actions.recovery import RecoveryRunner
from trainguard.actions.state import InvalidStateTransition, RecoveryState
from trainguard.infra.backoff import Backoff
from trainguard.infra.bus import (
    Batch,
    BusError,
    EventConsumer,
    EventProducer,
    authentic,
    coordinates,
    poisoned,
    seek_back,
    signer_for,
    verifier_for,
)
from trainguard.infra.config import Settings
from trainguard.infra.metrics_server import MetricsServer, serve_metrics
from trainguard.infra.signing import AuthError
from trainguard.schemas.base import now_ms
from trainguard.schemas.codec import decode, encode
from trainguard.schemas.control import ActionEvent, ActionPhase, Decision, JobSpec, Targets, stable_id
from trainguard.schemas.topics import ACTIONS, DEAD_LETTERS, DECISIONS, JOBS

log = logging.getLogger(__name__)

#: times a recovery's run may crash (an exception out of the runner, not a failed step) before it
#: is failed and dead-lettered instead of being retried at every dispatch forever.
MAX_RECOVERY_CRASHES = 3

#: a record's handler: (consumed record, stage, the exception it raised) -> dead-letter it.
Reject = Callable[[Any, str, BaseException], None]


def transient(exc: BaseException) -> bool:
    """The world is down (retry the record later), not the record bad (dead-letter it).

    The progress store's disk or lock (``sqlite3.OperationalError``: locked, I/O error, full),
    the OS, memory, Kafka: these fail every record alike, so skipping the record would lose it
    for nothing.  Anything else a record's handling raises (``UnicodeEncodeError`` from a lone
    surrogate, ``ValueError``, ``TypeError``, a constraint) is that record's fault.

    >>> transient(sqlite3.OperationalError("database is locked")), transient(ValueError("bad"))
    (True, False)
    """
    if isinstance(exc, OSError | MemoryError | BusError | sqlite3.OperationalError | sqlite3.InternalError):
        return True
    return type(exc).__module__.split(".")[0] in ("kafka", "aiokafka")


class BadlyDated(ValueError):
    """A record dated too far in the past or the future to act on (dead-lettered, never retried)."""


def check_dated(
    ts_ms: int, now_ms: int, cfg: ActionsConfig, what: str, max_age_s: float | None = None
) -> None:
    """Raise :class:`BadlyDated` if ``ts_ms`` is later than ``now_ms`` plus the clock-skew allowance,
    or older than ``max_age_s``.

    >>> cfg = ActionsConfig(clock_skew_s=60, max_decision_age_s=900)
    >>> check_dated(1_000_000, 1_030_000, cfg, "decision", max_age_s=900)
    >>> check_dated(2_000_000, 1_000_000, cfg, "job spec")
    Traceback (most recent call last):
    ...
    trainguard.actions.service.BadlyDated: job spec dated 1000 s in the future (clock skew allowance 60 s)
    """
    ahead_s = (ts_ms - now_ms) / 1000
    if ahead_s > cfg.clock_skew_s:
        raise BadlyDated(
            f"{what} dated {ahead_s:.0f} s in the future (clock skew allowance {cfg.clock_skew_s:g} s)"
        )
    if max_age_s is not None and -ahead_s > max_age_s:
        raise BadlyDated(f"{what} is {-ahead_s:.0f} s old (at most {max_age_s:g} s is acted on)")


class RetryLater(RuntimeError):
    """Handling a record hit the world being down; the reader seeked back to re-read it."""


def _seek_back_quietly(consumer: Any, records: Sequence[Any]) -> None:
    try:
        seek_back(consumer, records)
    except Exception as exc:  # a consumer that cannot seek re-reads from its committed offsets
        log.warning("could not seek back to %d record(s): %s", len(records), exc)


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
    instance needs every spec).

    Each record is handled on its own: garbage is dead-lettered at stage ``decode`` (the workers'
    sink does the same with the same key, so ClickHouse keeps one), a spec the store cannot take
    at ``actions:jobs``; either way the reader moves past it, so one bad spec on this long-retained
    topic cannot stop every later start.  A store that is down (:func:`transient`) seeks the reader
    back and raises :class:`RetryLater`.
    """

    def __init__(
        self,
        settings: Settings,
        store: ProgressStore,
        wanted: Callable[[str], bool],
        reject: Reject | None = None,
        dated: Callable[[int], None] | None = None,
        verifier: Any = None,
    ) -> None:
        from kafka import KafkaConsumer, TopicPartition

        self.store, self.wanted = store, wanted
        #: raises for a spec dated too far in the future (a wrong clock or a forged spec would
        #: otherwise win "latest spec wins" over every real one to come).
        self.dated = dated or (lambda _ts: None)
        #: a spec decides where a job runs: one whose signature fails is dead-lettered (``auth``).
        self.verifier = verifier
        self.reject: Reject = reject or _log_only
        self.consumer = KafkaConsumer(
            **settings.kafka.client_kwargs(), group_id=None, enable_auto_commit=False
        )
        parts = [TopicPartition(JOBS.name, p) for p in range(settings.kafka.partitions(JOBS))]
        self.consumer.assign(parts)
        self.consumer.seek_to_beginning(*parts)

    def poll(self, timeout_ms: int = 0) -> int:
        seen = 0
        records = [
            r for recs in self.consumer.poll(timeout_ms=timeout_ms, max_records=5000).values() for r in recs
        ]
        for i, r in enumerate(records):
            try:
                seen += self._handle(r)
            except RetryLater:
                _seek_back_quietly(self.consumer, records[i:])
                raise
        return seen

    def _handle(self, r: Any) -> int:
        why = authentic(self.verifier, r)
        if why:
            self.reject(r, "auth", AuthError(why))
            return 0
        try:
            spec = decode(r.value, expect=JobSpec)
        except Exception as exc:
            self.reject(r, "decode", exc)
            return 0
        try:
            if isinstance(spec, JobSpec) and self.wanted(spec.job):
                self.dated(spec.ts_ms)
                self.store.save_spec(spec)
                return 1
        except Exception as exc:
            if transient(exc):
                raise RetryLater(f"storing the job spec at {coordinates(r)}: {exc}") from exc
            self.reject(r, "actions:jobs", exc)
        return 0

    def close(self) -> None:
        self.consumer.close()


class DecisionSource(Protocol):
    """Where decisions come from (:class:`trainguard.infra.bus.EventConsumer`)."""

    def poll(self, timeout_ms: int = 1000) -> Batch: ...

    def commit(self) -> None: ...

    def seek_back(self, records: Sequence[Any]) -> None: ...

    def close(self) -> None: ...


class ActionService:
    """Consumer loop + per-job workers; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        cfg: ActionsConfig,
        executor: Executor | None = None,
        clock: Callable[[], int] = now_ms,
        producer: EventProducer | None = None,
    ) -> None:
        self.settings, self.cfg, self.clock = settings, cfg, clock
        self.dir = state_dir(settings, cfg)
        self.store = ProgressStore(self.dir / "progress.sqlite")
        self.metrics = ActionMetrics()
        self.metrics.watch(self.store)
        self.store.on_transition = self.metrics.transition
        self._metrics_server: MetricsServer | None = None
        signer = signer_for(settings, "actions")
        env = ExecutorEnv(
            state_dir=self.dir / "executor", kafka_bootstrap=settings.kafka.bootstrap_servers, signer=signer
        )
        self.executor = executor or create_executor(cfg.executor, cfg.executor_options, env)
        self.producer = producer or EventProducer(settings.kafka, linger_ms=0, signer=signer)
        #: decisions and job specs are acted on only with a valid signature (None: signing off).
        self.verifier = verifier_for(settings)
        self.publisher = KafkaPublisher(self.producer)
        self.stop_event = threading.Event()
        self.runner = RecoveryRunner(
            cfg,
            self.store,
            self.executor,
            self.publisher,
            self.store.spec,
            self.stop_event,
            clock,
            metrics=self.metrics,
        )
        self._workers: dict[str, threading.Thread] = {}
        # Warm-up (e.g. a torch-preloading diagnostics server) off the main loop, before any recovery.
        threading.Thread(target=self.executor.prepare, name="executor-prepare", daemon=True).start()
        self._consumer: DecisionSource | None = None
        self._jobs: JobsFollower | None = None
        self._stop: threading.Event | None = None
        #: waits between retries while the broker or the store is down.
        self.backoff = Backoff(initial_s=0.5, max_s=10.0)
        self.accepted = 0
        self.redelivered = 0
        #: records (decisions, job specs) and recoveries dead-lettered since the start.
        self.dead_lettered = 0
        #: decision id -> (partition, offset) it was consumed at, for dead-lettering its recovery.
        self._origins: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._crashes: dict[str, int] = {}
        #: pause after a recovery's run crashed, before the next dispatch retries it.
        self.crash_pause_s = 1.0
        self._last_trouble = ("", 0.0)
        self._pause_logged = 0.0

    def wanted(self, job: str) -> bool:
        return not self.cfg.jobs or job in self.cfg.jobs

    # --- loop ------------------------------------------------------------------------------------

    def start_consuming(self) -> None:
        """Open the decisions consumer and the jobs reader."""
        self._consumer = EventConsumer(
            self.settings.kafka,
            [DECISIONS.name],
            self.cfg.consumer_group,
            producer=self.producer,
            verifier=self.verifier,
            # A new service (a new group) starts at the oldest decision it would still act on.
            start_ms=now_ms() - int(self.cfg.max_decision_age_s * 1000),
            session_timeout_ms=10_000,
            max_poll_records=500,
        )
        self._jobs = JobsFollower(
            self.settings,
            self.store,
            self.wanted,
            self.reject,
            dated=lambda ts: check_dated(ts, self.clock(), self.cfg, "job spec"),
            verifier=self.verifier,
        )

    def serve_metrics(self) -> int | None:
        """Serve ``/metrics`` (if configured and not yet served); the port, or None."""
        if self._metrics_server is None:
            c = self.cfg
            self._metrics_server = serve_metrics(
                self.metrics.registry, c.metrics_host, c.metrics_port, "action service"
            )
        return self._metrics_server.port if self._metrics_server is not None else None

    def run(self, stop: threading.Event | None = None) -> None:
        """Run until ``stop`` (or :meth:`shutdown`) is set."""
        self.serve_metrics()  # first: a service that cannot reach its broker is seen doing so
        if self._consumer is None:
            self.start_consuming()
        stop = self._stop = stop or self.stop_event
        try:
            while not self.stopping():
                self.tick(int(self.cfg.poll_interval_s * 1000))
        finally:
            self.shutdown()

    def stopping(self) -> bool:
        return self.stop_event.is_set() or (self._stop is not None and self._stop.is_set())

    def tick(self, timeout_ms: int) -> None:
        """One round of the main loop (public so tests and embedders can drive it).

        Never raises for a bad record or for the world being down: the first is dead-lettered,
        the second waits (:attr:`backoff`) and is read again next round."""
        assert self._consumer is not None and self._jobs is not None
        if self.follow_jobs() and self.take_decisions(timeout_ms):
            self.follow_jobs()
            self.backoff.reset()
        self.housekeeping()

    def follow_jobs(self) -> bool:
        """Read what is new on the jobs topic; False if the broker or the store is down."""
        assert self._jobs is not None
        try:
            self._jobs.poll(0)
            return True
        except Exception as exc:  # the reader's own records are handled one by one inside
            self._world_down("reading the jobs topic", exc)
            return False

    def take_decisions(self, timeout_ms: int) -> bool:
        """Accept the next batch of decisions, each in its own ``try``, then commit past it.

        False (nothing committed, the unhandled records seeked back to) if the broker or the
        store is down."""
        assert self._consumer is not None
        try:
            batch = self._consumer.poll(timeout_ms=timeout_ms)
        except Exception as exc:  # undecodable records come back as dead letters, not exceptions
            self._world_down("reading decisions", exc)
            return False
        self.metrics.decisions_received.inc(len(batch.events) + len(batch.dead_letters))
        for dl in batch.dead_letters:  # the consumer published these (stage decode or auth)
            self.dead_lettered += 1
            self.metrics.dead_letters.labels(dl.stage).inc()
            reason = dl.stage if dl.stage in REJECT_REASONS else "invalid"
            self.metrics.decisions_rejected.labels(reason).inc()
            log.error("decode: dead-lettered %s[%d]@%d: %s", dl.topic, dl.partition, dl.offset, dl.reason)
        pairs = batch.pairs()
        rejected = False
        for i, (rec, ev) in enumerate(pairs):
            try:
                if isinstance(ev, Decision) and self.wanted(ev.job):
                    self.accept(ev)
                    if rec is not None:
                        self._remember_origin(ev.decision_id, rec)
            except Exception as exc:
                if self.stopping() or transient(exc):
                    self._seek_back([r for r, _ in pairs[i:]])
                    self._world_down(f"accepting the decision at {_where(rec)}", exc)
                    return False
                self.reject(rec if rec is not None else _stand_in(ev), "actions:accept", exc)
                self.metrics.decisions_rejected.labels(
                    "badly_dated" if isinstance(exc, BadlyDated) else "invalid"
                ).inc()
                rejected = True
        if batch.events or batch.dead_letters:
            try:
                if rejected:
                    self.producer.flush()  # the dead letters are on the topic before we commit past
                self._consumer.commit()  # after every decision of the batch is in the store
            except Exception as exc:
                self._seek_back([r for r, _ in pairs])
                self._world_down("committing decisions", exc)
                return False
        return True

    def reject(self, record: Any, stage: str, exc: BaseException) -> None:
        """Dead-letter a consumed record whose handling failed at ``stage`` (logged once, counted)."""
        dl = poisoned(record, stage, exc, log)
        self.dead_lettered += 1
        self.metrics.dead_letters.labels(stage).inc()
        try:
            self.producer.send(dl, DEAD_LETTERS)
        except Exception as send_exc:  # logged above with its coordinates; the record is still skipped
            log.warning("could not publish the dead letter for %s: %s", _where(record), send_exc)

    def _remember_origin(self, decision_id: str, rec: Any) -> None:
        self._origins[decision_id] = (int(rec.partition), int(rec.offset))
        self._origins.move_to_end(decision_id)
        while len(self._origins) > 10_000:
            self._origins.popitem(last=False)

    def _seek_back(self, records: list[Any]) -> None:
        assert self._consumer is not None
        known = [r for r in records if r is not None]
        if not known:
            return
        try:
            self._consumer.seek_back(known)
        except Exception as exc:  # then the group re-reads from the committed offsets after a restart
            log.warning("could not seek back to %d decision record(s): %s", len(known), exc)

    def _world_down(self, what: str, exc: BaseException) -> None:
        delay = self.backoff.next_delay()
        log.warning("%s failed (%s: %s); retrying in %.1f s", what, type(exc).__name__, exc, delay)
        self._pause(delay)

    def _pause(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping() and (left := deadline - time.monotonic()) > 0:
            self.stop_event.wait(min(left, 0.2))

    def housekeeping(self) -> None:
        """Forced updates and dispatch; an error here is logged (not every round), never fatal."""
        try:
            self.force_overdue_updates()
            self.dispatch()
        except Exception as exc:
            text, last = self._last_trouble
            now = time.monotonic()
            if str(exc) != text or now - last > 60:
                log.exception("dispatching recoveries failed (retried every round)")
                self._last_trouble = (str(exc), now)

    def accept(self, decision: Decision) -> bool:
        now = self.clock()
        if self.store.get(decision.decision_id) is None:  # a redelivery was checked the first time
            check_dated(decision.ts_ms, now, self.cfg, "decision", max_age_s=self.cfg.max_decision_age_s)
        if self.store.accept(decision, now):
            self.accepted += 1
            self.metrics.decisions_accepted.inc()
            log.info(
                "accepted decision %s (%s) for job %s", decision.decision_id, decision.action, decision.job
            )
            return True
        self.redelivered += 1
        self.metrics.decisions_redelivered.inc()
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
        pause = self.store.paused()
        if pause is not None:  # recoveries in flight stop before their next step (the runner checks)
            if time.monotonic() - self._pause_logged > 60:
                self._pause_logged = time.monotonic()
                log.warning(
                    "paused by %s since %d: %s; decisions are queued, no recovery step runs until "
                    "`trainguard actions resume`",
                    pause["by"],
                    pause["ts_ms"],
                    pause["reason"],
                )
            return
        self._pause_logged = 0.0
        for job in self.store.jobs_with_work():
            t = self._workers.get(job)
            if t is not None and t.is_alive():
                continue
            t = threading.Thread(target=self._work, args=(job,), name=f"recover-{job}", daemon=True)
            self._workers[job] = t
            t.start()

    def _work(self, job: str) -> None:
        while not self.stop_event.is_set():
            try:
                head = self.store.head_of_job(job)
            except Exception:  # the store away: retried at a later dispatch
                log.exception("reading the queue of job %s failed", job)
                self.stop_event.wait(self.crash_pause_s)
                return
            if head is None or head.state is RecoveryState.HELD:
                return
            try:
                rec = self.runner.run(head.decision_id)
            except Exception as exc:
                if not self._crashed(head.decision_id, exc):
                    return  # retried at a later dispatch
                continue  # given up on: the job's next recovery
            self._crashes.pop(head.decision_id, None)
            if not rec.state.terminal:
                return  # held, or stopping

    def _crashed(self, decision_id: str, exc: BaseException) -> bool:
        """A recovery's run raised: True once it has been failed and dead-lettered (after
        :data:`MAX_RECOVERY_CRASHES` crashes of its own), False to retry it later."""
        if self.stop_event.is_set() or transient(exc):  # the store or the broker away: not its fault
            log.warning(
                "recovery %s interrupted (%s: %s); retried later", decision_id, type(exc).__name__, exc
            )
            self.stop_event.wait(self.crash_pause_s)
            return False
        self.metrics.crashes.inc()
        n = self._crashes[decision_id] = self._crashes.get(decision_id, 0) + 1
        if n < MAX_RECOVERY_CRASHES:
            log.warning(
                "recovery %s crashed (%d of %d): %s: %s",
                decision_id,
                n,
                MAX_RECOVERY_CRASHES,
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
            self.stop_event.wait(self.crash_pause_s)
            return False
        try:
            self.give_up(decision_id, exc)
        except Exception:  # the store away: tried again after the next crash
            log.exception("could not give up on recovery %s", decision_id)
            self.stop_event.wait(self.crash_pause_s)
            return False
        self._crashes.pop(decision_id, None)
        return True

    def give_up(self, decision_id: str, exc: BaseException) -> None:
        """Fail a recovery whose run keeps crashing and dead-letter its decision (``actions:recover``)."""
        rec = self.store.get(decision_id)
        if rec is None or rec.state.terminal:
            return
        detail = f"recovery crashed {MAX_RECOVERY_CRASHES} times: {type(exc).__name__}: {exc}"[:60_000]
        # A crash while replenishing: the job already runs again (the table allows only success).
        end = RecoveryState.SUCCEEDED if rec.state is RecoveryState.REPLENISHING else RecoveryState.FAILED
        try:
            rec = self.store.transition(decision_id, end, finished_ms=self.clock(), detail=detail)
        except (InvalidStateTransition, KeyError) as move_exc:  # moved meanwhile (an operator)
            log.warning("could not end crashed recovery %s: %s", decision_id, move_exc)
            return
        partition, offset = self._origins.get(decision_id, (-1, -1))
        self.reject(_stand_in(rec.decision, partition, offset), "actions:recover", exc)
        d = rec.decision
        try:
            self.publisher.action(
                ActionEvent(
                    event_id=stable_id(d.decision_id, "recovery", ActionPhase.FAILED.value, 0),
                    decision_id=d.decision_id,
                    ts_ms=self.clock(),
                    job=d.job,
                    step="recovery",
                    phase=ActionPhase.FAILED if end is RecoveryState.FAILED else ActionPhase.SUCCEEDED,
                    action=d.action,
                    detail=f"{end.value}: {detail}"[:60_000],
                    targets=Targets(machines=[], ranks=[], group_kind=d.targets.group_kind),
                )
            )
        except Exception as pub_exc:
            log.warning("could not publish the end of crashed recovery %s: %s", decision_id, pub_exc)

    def idle(self) -> bool:
        """No worker is running (tests wait for this)."""
        return not any(t.is_alive() for t in self._workers.values())

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self.stop_event.set()
        for t in self._workers.values():
            t.join(timeout_s)
        if self._metrics_server is not None:  # before the store closes: a scrape reads it
            self._metrics_server.close()
            self._metrics_server = None
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


def _log_only(record: Any, stage: str, exc: BaseException) -> None:
    poisoned(record, stage, exc, log)


def _where(record: Any) -> str:
    return coordinates(record) if record is not None else "an unknown offset"


def _stand_in(decision: Any, partition: int = -1, offset: int = -1) -> Any:
    """A record-like object for a decision whose consumed record is not at hand."""
    try:
        value = encode(decision)
    except Exception:
        value = repr(decision).encode("utf-8", "backslashreplace")
    key = getattr(decision, "job", "")
    return SimpleNamespace(
        topic=DECISIONS.name,
        partition=partition,
        offset=offset,
        key=key.encode("utf-8", "backslashreplace") if isinstance(key, str) else None,
        value=value,
    )


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
