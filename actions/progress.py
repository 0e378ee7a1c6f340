"""Durable progress of recoveries: the action service's memory across restarts (SQLite).

Why SQLite (stdlib ``sqlite3``): the service is the single writer of its own progress; what it
needs is *atomic, durable, local* records -- "step X of decision D is done, and these machines
were evicted" in one transaction that survives ``kill -9`` (WAL, ``synchronous=FULL``) -- plus
concurrent readers (``trainguard actions status``/``release`` from another process).  No server
to run, nothing to install.  A replicated service on several hosts would move these tables to a
shared database; the :class:`ProgressStore` methods are the seam.

Tables:

* ``recoveries`` -- one row per decision id (the idempotency key): decision, state, the plan
  context frozen at start, path, timings, hold reason;
* ``steps`` -- (decision id, step key) -> attempts, status, result, whether its events were sent;
* ``evictions`` / ``restarts`` -- logs read by the blast-radius guard and the restart budget (the
  circuit breaker reads the evict decisions in ``recoveries``);
* ``code_changes`` -- every code version change per job (baseline, updates, rollbacks), pending
  lazy updates included: traceable and reproducible (§6.1);
* ``specs`` -- the latest JobSpec per job seen on the jobs topic or published by the service;
* ``pool_offers`` -- machines an operator put into a job's standby pool
  (``trainguard actions add-standby`` / ``return-node``): a returned machine is no longer
  excluded as evicted (until it is evicted again), and a swap may take any offered one.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.actions.state import TERMINAL, RecoveryState, check_transition
from trainguard.schemas.codec import decode, encode
from trainguard.schemas.control import Decision, JobSpec
from trainguard.schemas.enums import Action

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS recoveries (
    decision_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    job TEXT NOT NULL,
    action TEXT NOT NULL,
    decision BLOB NOT NULL,
    state TEXT NOT NULL,
    context TEXT,
    path TEXT NOT NULL DEFAULT '',
    next_level INTEGER,
    accepted_ms INTEGER NOT NULL,
    started_ms INTEGER,
    finished_ms INTEGER,
    held_reason TEXT NOT NULL DEFAULT '',
    held_step TEXT NOT NULL DEFAULT '',
    released TEXT NOT NULL DEFAULT '[]',
    detail TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS recoveries_job ON recoveries (job, seq);
CREATE TABLE IF NOT EXISTS steps (
    decision_id TEXT NOT NULL,
    key TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    status TEXT NOT NULL,
    started_ms INTEGER,
    finished_ms INTEGER,
    result TEXT,
    announced INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (decision_id, key)
);
CREATE TABLE IF NOT EXISTS evictions (
    decision_id TEXT NOT NULL,
    machine TEXT NOT NULL,
    job TEXT NOT NULL,
    ts_ms INTEGER NOT NULL,
    PRIMARY KEY (decision_id, machine)
);
CREATE TABLE IF NOT EXISTS restarts (
    decision_id TEXT PRIMARY KEY,
    job TEXT NOT NULL,
    ts_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS code_changes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job TEXT NOT NULL,
    version TEXT NOT NULL,
    kind TEXT NOT NULL,
    urgent INTEGER NOT NULL DEFAULT 0,
    status TEXT NOT NULL,
    requested_ms INTEGER NOT NULL,
    applied_ms INTEGER,
    decision_id TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    UNIQUE (decision_id, kind, version)
);
CREATE TABLE IF NOT EXISTS specs (
    job TEXT PRIMARY KEY,
    ts_ms INTEGER NOT NULL,
    spec BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS pool_offers (
    job TEXT NOT NULL,
    machine TEXT NOT NULL,
    kind TEXT NOT NULL,
    by TEXT NOT NULL,
    ts_ms INTEGER NOT NULL,
    PRIMARY KEY (job, machine)
);
CREATE TABLE IF NOT EXISTS pause (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    reason TEXT NOT NULL,
    by TEXT NOT NULL,
    ts_ms INTEGER NOT NULL
);
"""


def _readable(event: Decision | JobSpec, cls: type[Decision] | type[JobSpec]) -> bytes:
    """``event`` encoded, after checking that it decodes again (what the store will do)."""
    raw = encode(event)
    decode(raw, expect=cls)
    return raw


@dataclass(frozen=True)
class Recovery:
    """One row of ``recoveries``."""

    decision_id: str
    seq: int
    job: str
    decision: Decision
    state: RecoveryState
    context: dict[str, Any] | None
    path: str
    next_level: int | None
    accepted_ms: int
    started_ms: int | None
    finished_ms: int | None
    held_reason: str
    held_step: str
    released: list[str]
    detail: str


@dataclass(frozen=True)
class CodeChange:
    id: int
    job: str
    version: str
    kind: str  # baseline / update / rollback
    urgent: bool
    status: str  # pending / applied / superseded
    requested_ms: int
    applied_ms: int | None
    decision_id: str
    reason: str


class ProgressStore:
    """Thread-safe (one connection, one lock) SQLite store of recovery progress."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        #: called with (old state, new state) after every committed state change (the metrics).
        self.on_transition: Callable[[RecoveryState, RecoveryState], None] | None = None
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a step recorded as done is on disk before the next step starts (kill -9 safe).
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            cur = self._db.execute(sql, args)
            cur.row_factory = sqlite3.Row
            return list(cur.fetchall())

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- recoveries ------------------------------------------------------------------------------

    def accept(self, decision: Decision, now_ms: int) -> bool:
        """Record a decision as a pending recovery; False if its id is known (a redelivery).

        Raises (``UnicodeEncodeError``, ``DecodeError``...) for a decision the store could not read
        back -- e.g. a lone surrogate in a string -- before anything is written: a stored row that
        cannot be decoded would block its job's queue for good."""
        raw = _readable(decision, Decision)
        with self._tx() as c:
            seq = c.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM recoveries").fetchone()[0]
            cur = c.execute(
                "INSERT OR IGNORE INTO recoveries"
                " (decision_id, seq, job, action, decision, state, accepted_ms) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    decision.decision_id,
                    seq,
                    decision.job,
                    decision.action.value,
                    raw,
                    RecoveryState.PENDING.value,
                    now_ms,
                ),
            )
            return cur.rowcount == 1

    def _recovery(self, r: sqlite3.Row) -> Recovery:
        dec = decode(r["decision"], expect=Decision)
        assert isinstance(dec, Decision)
        return Recovery(
            decision_id=r["decision_id"],
            seq=r["seq"],
            job=r["job"],
            decision=dec,
            state=RecoveryState(r["state"]),
            context=json.loads(r["context"]) if r["context"] else None,
            path=r["path"],
            next_level=r["next_level"],
            accepted_ms=r["accepted_ms"],
            started_ms=r["started_ms"],
            finished_ms=r["finished_ms"],
            held_reason=r["held_reason"],
            held_step=r["held_step"],
            released=json.loads(r["released"]),
            detail=r["detail"],
        )

    def get(self, decision_id: str) -> Recovery | None:
        rows = self._rows("SELECT * FROM recoveries WHERE decision_id = ?", (decision_id,))
        return self._recovery(rows[0]) if rows else None

    def recoveries(self, job: str | None = None, limit: int = 1000) -> list[Recovery]:
        sql, args = "SELECT * FROM recoveries", tuple[str, ...]()
        if job:
            sql, args = sql + " WHERE job = ?", (job,)
        rows = self._rows(sql + " ORDER BY seq DESC LIMIT ?", (*args, limit))
        return [self._recovery(r) for r in reversed(rows)]

    def head_of_job(self, job: str) -> Recovery | None:
        """The job's oldest unfinished recovery: the one the job's queue is at (held included)."""
        terminal = tuple(s.value for s in TERMINAL)
        marks = ",".join("?" * len(terminal))
        rows = self._rows(
            f"SELECT * FROM recoveries WHERE job = ? AND state NOT IN ({marks}) ORDER BY seq LIMIT 1",
            (job, *terminal),
        )
        return self._recovery(rows[0]) if rows else None

    def jobs_with_work(self) -> list[str]:
        """Jobs whose queue head is runnable (not held)."""
        terminal = tuple(s.value for s in TERMINAL)
        marks = ",".join("?" * len(terminal))
        rows = self._rows(
            f"SELECT DISTINCT job FROM recoveries WHERE state NOT IN ({marks}) ORDER BY job", terminal
        )
        out = []
        for r in rows:
            head = self.head_of_job(r["job"])
            if head is not None and head.state is not RecoveryState.HELD:
                out.append(r["job"])
        return out

    def transition(self, decision_id: str, new: RecoveryState, **fields: Any) -> Recovery:
        """Move a recovery to ``new`` (checked against the state table) and set ``fields``."""
        allowed = {
            "context",
            "path",
            "next_level",
            "started_ms",
            "finished_ms",
            "held_reason",
            "held_step",
            "detail",
        }
        bad = set(fields) - allowed
        if bad:
            raise KeyError(f"unknown recovery field(s) {sorted(bad)}")
        with self._tx() as c:
            row = c.execute("SELECT state FROM recoveries WHERE decision_id = ?", (decision_id,)).fetchone()
            if row is None:
                raise KeyError(f"no recovery {decision_id}")
            old = RecoveryState(row[0])
            check_transition(old, new)
            if "context" in fields and fields["context"] is not None:
                fields["context"] = json.dumps(fields["context"])
            sets = ", ".join(["state = ?", *(f"{k} = ?" for k in fields)])
            c.execute(
                f"UPDATE recoveries SET {sets} WHERE decision_id = ?",
                (new.value, *fields.values(), decision_id),
            )
        self._moved(old, new)
        rec = self.get(decision_id)
        assert rec is not None
        return rec

    def _moved(self, old: RecoveryState, new: RecoveryState) -> None:
        if self.on_transition is not None:
            try:
                self.on_transition(old, new)
            except Exception as exc:  # counting a move must never undo or fail it
                log.warning("recovery transition hook failed: %s", exc)

    def open_by_state(self) -> dict[RecoveryState, tuple[int, int]]:
        """Unfinished recoveries per state: (how many, the oldest one's start, or acceptance if
        it has not started, in ms)."""
        terminal = tuple(s.value for s in TERMINAL)
        marks = ",".join("?" * len(terminal))
        rows = self._rows(
            "SELECT state, COUNT(*) AS n, MIN(COALESCE(started_ms, accepted_ms)) AS since FROM recoveries"
            f" WHERE state NOT IN ({marks}) GROUP BY state",
            terminal,
        )
        return {RecoveryState(r["state"]): (int(r["n"]), int(r["since"])) for r in rows}

    def release(self, decision_id: str) -> Recovery:
        """Operator: let a held recovery go past the limit that held it, once.

        The recovery returns to the state of the step it was held at; the runner re-plans from
        the recorded results and runs that step without the check that held it.
        """
        from trainguard.actions.plans import STATE_OF, StepKind  # plans imports nothing from here

        rec = self.get(decision_id)
        if rec is None or rec.state is not RecoveryState.HELD:
            raise ValueError(f"recovery {decision_id} is not held")
        if rec.held_step not in {k.value for k in StepKind}:
            raise ValueError(
                f"recovery {decision_id} is held by its plan ({rec.held_reason}); cancel it instead"
            )
        state = STATE_OF[StepKind(rec.held_step)]
        with self._tx() as c:
            check_transition(rec.state, state)
            c.execute(
                "UPDATE recoveries SET released = ?, state = ?, held_reason = '' WHERE decision_id = ?",
                (json.dumps(sorted({*rec.released, rec.held_step})), state.value, decision_id),
            )
        self._moved(rec.state, state)
        out = self.get(decision_id)
        assert out is not None
        return out

    # --- steps -----------------------------------------------------------------------------------

    def step_started(self, decision_id: str, key: str, now_ms: int) -> int:
        """Count an attempt of a step (before the executor is called); returns the attempt number."""
        with self._tx() as c:
            c.execute(
                "INSERT INTO steps (decision_id, key, attempts, status, started_ms)"
                " VALUES (?, ?, 1, 'running', ?)"
                " ON CONFLICT (decision_id, key) DO UPDATE SET attempts = attempts + 1, status = 'running'",
                (decision_id, key, now_ms),
            )
            return int(
                c.execute(
                    "SELECT attempts FROM steps WHERE decision_id = ? AND key = ?", (decision_id, key)
                ).fetchone()[0]
            )

    def step_done(
        self,
        decision_id: str,
        key: str,
        result: dict[str, Any],
        now_ms: int,
        *,
        job: str = "",
        evicted: list[str] | None = None,
        restarted: bool = False,
        code_applied: tuple[str, str, str] | None = None,
    ) -> None:
        """Record a finished step and its side effects in one transaction.

        ``code_applied`` is ``(version, kind, reason)``: the job now runs ``version``.
        """
        with self._tx() as c:
            c.execute(
                "INSERT INTO steps (decision_id, key, attempts, status, finished_ms, result)"
                " VALUES (?, ?, 1, 'done', ?, ?) ON CONFLICT (decision_id, key) DO UPDATE"
                " SET status = 'done', finished_ms = excluded.finished_ms, result = excluded.result",
                (decision_id, key, now_ms, json.dumps(result)),
            )
            for m in evicted or []:
                c.execute(
                    "INSERT OR IGNORE INTO evictions (decision_id, machine, job, ts_ms) VALUES (?, ?, ?, ?)",
                    (decision_id, m, job, now_ms),
                )
            if restarted:
                c.execute(
                    "INSERT OR IGNORE INTO restarts (decision_id, job, ts_ms) VALUES (?, ?, ?)",
                    (decision_id, job, now_ms),
                )
            if code_applied is not None:
                version, kind, reason = code_applied
                if kind == "update":  # the queued request (if any) is now applied, older ones superseded
                    c.execute(
                        "UPDATE code_changes SET status = 'superseded' WHERE job = ? AND status = 'pending'"
                        " AND version != ?",
                        (job, version),
                    )
                    applied = c.execute(
                        "UPDATE code_changes SET status = 'applied', applied_ms = ? WHERE job = ?"
                        " AND status = 'pending' AND version = ?",
                        (now_ms, job, version),
                    ).rowcount
                    if applied:
                        return
                c.execute(
                    "INSERT OR IGNORE INTO code_changes"
                    " (job, version, kind, status, requested_ms, applied_ms, decision_id, reason)"
                    " VALUES (?, ?, ?, 'applied', ?, ?, ?, ?)",
                    (job, version, kind, now_ms, now_ms, decision_id, reason),
                )

    def step_failed(self, decision_id: str, key: str, error: str, now_ms: int) -> None:
        with self._tx() as c:
            c.execute(
                "UPDATE steps SET status = 'failed', finished_ms = ?, result = ?"
                " WHERE decision_id = ? AND key = ?",
                (now_ms, json.dumps({"error": error}), decision_id, key),
            )

    def step_skipped(self, decision_id: str, key: str, reason: str, now_ms: int) -> bool:
        """Record that the plan skipped rung ``key`` (``reason``: why it cannot run); False when it
        was recorded before (the plan is rebuilt after every step)."""
        with self._tx() as c:
            cur = c.execute(
                "INSERT OR IGNORE INTO steps (decision_id, key, attempts, status, finished_ms, result)"
                " VALUES (?, ?, 0, 'skipped', ?, ?)",
                (decision_id, key, now_ms, json.dumps({"skipped": reason})),
            )
            return cur.rowcount == 1

    def step_results(self, decision_id: str) -> dict[str, Any]:
        rows = self._rows(
            "SELECT key, result FROM steps WHERE decision_id = ? AND status = 'done'", (decision_id,)
        )
        return {r["key"]: json.loads(r["result"]) for r in rows}

    def steps(self, decision_id: str) -> list[dict[str, Any]]:
        rows = self._rows(
            "SELECT key, attempts, status, started_ms, finished_ms, result, announced FROM steps"
            " WHERE decision_id = ? ORDER BY COALESCE(started_ms, finished_ms)",
            (decision_id,),
        )
        return [dict(r) for r in rows]

    def unannounced(self, decision_id: str) -> list[str]:
        rows = self._rows(
            "SELECT key FROM steps WHERE decision_id = ? AND status = 'done' AND announced = 0",
            (decision_id,),
        )
        return [r["key"] for r in rows]

    def mark_announced(self, decision_id: str, key: str) -> None:
        with self._tx() as c:
            c.execute("UPDATE steps SET announced = 1 WHERE decision_id = ? AND key = ?", (decision_id, key))

    # --- operator pause ----------------------------------------------------------------------------

    def pause(self, reason: str, by: str, now_ms: int) -> None:
        """Stop starting recovery steps (decisions are still accepted and queued) until resumed."""
        with self._tx() as c:
            c.execute(
                "INSERT OR REPLACE INTO pause (id, reason, by, ts_ms) VALUES (1, ?, ?, ?)",
                (reason, by, now_ms),
            )

    def resume(self) -> bool:
        """Lift the pause; False when the service was not paused."""
        with self._tx() as c:
            return c.execute("DELETE FROM pause WHERE id = 1").rowcount > 0

    def paused(self) -> dict[str, Any] | None:
        """The pause in force (reason, by, ts_ms), or None."""
        rows = self._rows("SELECT reason, by, ts_ms FROM pause WHERE id = 1")
        return dict(rows[0]) if rows else None

    # --- guard and budget logs -------------------------------------------------------------------

    def reserve_evictions(
        self,
        decision_id: str,
        job: str,
        machines: list[str],
        since_ms: int,
        now_ms: int,
        refuse: Callable[[int, int], str],
    ) -> str:
        """Check the blast-radius caps and record the evictions in one transaction.

        ``refuse(per_job, total)`` gets the evictions in the window (of the job, of every job) the
        cap would count with these machines and says why not ("" to go on).  The machines are
        logged at once, before the evict step runs, so evictions in flight count for every other
        recovery checking at the same time; a resumed recovery finds its own rows and passes.
        """
        with self._tx() as c:
            rows = c.execute("SELECT machine FROM evictions WHERE decision_id = ?", (decision_id,))
            mine = {r[0] for r in rows}
            new = [m for m in dict.fromkeys(machines) if m not in mine]
            if not new:
                return ""
            count = "SELECT COUNT(*) FROM evictions WHERE ts_ms >= ?"
            per_job = c.execute(count + " AND job = ?", (since_ms, job)).fetchone()[0] + len(new)
            total = c.execute(count, (since_ms,)).fetchone()[0] + len(new)
            reason = refuse(int(per_job), int(total))
            if not reason:
                c.executemany(
                    "INSERT OR IGNORE INTO evictions (decision_id, machine, job, ts_ms) VALUES (?, ?, ?, ?)",
                    [(decision_id, m, job, now_ms) for m in new],
                )
            return reason

    def evictions_since(self, since_ms: int, job: str | None = None) -> int:
        if job is None:
            return int(
                self._rows("SELECT COUNT(*) AS n FROM evictions WHERE ts_ms >= ?", (since_ms,))[0]["n"]
            )
        rows = self._rows("SELECT COUNT(*) AS n FROM evictions WHERE ts_ms >= ? AND job = ?", (since_ms, job))
        return int(rows[0]["n"])

    def evicted_machines(self, job: str) -> set[str]:
        """Machines evicted from ``job`` and not offered back since (a swap never takes them)."""
        rows = self._rows(
            "SELECT e.machine FROM evictions e LEFT JOIN pool_offers o"
            " ON o.job = e.job AND o.machine = e.machine WHERE e.job = ?"
            " GROUP BY e.machine HAVING MAX(e.ts_ms) >= COALESCE(MAX(o.ts_ms), -1)",
            (job,),
        )
        return {r["machine"] for r in rows}

    # --- operator pool offers ----------------------------------------------------------------------

    def offer_machines(self, job: str, machines: list[str], kind: str, by: str, now_ms: int) -> None:
        """Put ``machines`` into ``job``'s standby pool (``kind``: ``standby`` for a machine new to
        the job, ``returned`` for one it evicted): a later offer of the same machine replaces an
        earlier one, and lifts the eviction exclusion of every eviction before it."""
        with self._tx() as c:
            c.executemany(
                "INSERT OR REPLACE INTO pool_offers (job, machine, kind, by, ts_ms) VALUES (?, ?, ?, ?, ?)",
                [(job, m, kind, by, now_ms) for m in dict.fromkeys(machines)],
            )

    def pool_offers(self, job: str) -> list[dict[str, Any]]:
        """The offers of ``job`` still in force (the machine not evicted since), oldest first."""
        evicted = self.evicted_machines(job)
        rows = self._rows(
            "SELECT machine, kind, by, ts_ms FROM pool_offers WHERE job = ? ORDER BY ts_ms, machine", (job,)
        )
        return [dict(r) for r in rows if r["machine"] not in evicted]

    def restarts_since(self, job: str, since_ms: int) -> int:
        rows = self._rows("SELECT COUNT(*) AS n FROM restarts WHERE job = ? AND ts_ms >= ?", (job, since_ms))
        return int(rows[0]["n"])

    def last_finished(
        self,
        job: str,
        before_seq: int,
        since_ms: int | None = None,
        shapes: Callable[[Recovery], bool] | None = None,
    ) -> Recovery | None:
        """The job's latest finished recovery that shapes escalation: accepted before
        ``before_seq``, finished at or after ``since_ms`` (if given), and one ``shapes`` takes
        (if given: the recovery runner's "same cause")."""
        sql = "SELECT * FROM recoveries WHERE job = ? AND seq < ? AND state = ? AND next_level IS NOT NULL"
        args: tuple[Any, ...] = (job, before_seq, RecoveryState.SUCCEEDED.value)
        if since_ms is not None:
            sql, args = sql + " AND finished_ms >= ?", (*args, since_ms)
        rows = self._rows(sql + " ORDER BY finished_ms DESC", args)
        for r in rows:
            rec = self._recovery(r)
            if shapes is None or shapes(rec):
                return rec
        return None

    def evictions_asked(self, job: str, since_ms: int) -> list[Recovery]:
        """The job's recoveries of ``evict`` decisions accepted at or after ``since_ms``, whatever
        their state (the circuit breaker weighs what was asked, done or not)."""
        rows = self._rows(
            "SELECT * FROM recoveries WHERE job = ? AND action = ? AND accepted_ms >= ? ORDER BY seq",
            (job, Action.EVICT.value, since_ms),
        )
        return [self._recovery(r) for r in rows]

    # --- code versions ---------------------------------------------------------------------------

    def request_update(
        self, job: str, version: str, decision_id: str, now_ms: int, previous: str = "", reason: str = ""
    ) -> None:
        """Queue a non-urgent update (idempotent by decision id); record ``previous`` as baseline."""
        with self._tx() as c:
            self._baseline(c, job, previous, decision_id, now_ms)
            c.execute(
                "INSERT OR IGNORE INTO code_changes"
                " (job, version, kind, status, requested_ms, decision_id, reason)"
                " VALUES (?, ?, 'update', 'pending', ?, ?, ?)",
                (job, version, now_ms, decision_id, reason),
            )

    def record_baseline(self, job: str, version: str, decision_id: str, now_ms: int) -> None:
        with self._tx() as c:
            self._baseline(c, job, version, decision_id, now_ms)

    @staticmethod
    def _baseline(c: sqlite3.Connection, job: str, version: str, decision_id: str, now_ms: int) -> None:
        if not version:
            return
        known = c.execute(
            "SELECT 1 FROM code_changes WHERE job = ? AND status = 'applied'", (job,)
        ).fetchone()
        if known is None:
            c.execute(
                "INSERT OR IGNORE INTO code_changes"
                " (job, version, kind, status, requested_ms, applied_ms, decision_id, reason)"
                " VALUES (?, ?, 'baseline', 'applied', ?, ?, ?, 'running before the first update')",
                (job, version, now_ms, now_ms, decision_id),
            )

    def code_changes(self, job: str) -> list[CodeChange]:
        rows = self._rows("SELECT * FROM code_changes WHERE job = ? ORDER BY id", (job,))
        return [
            CodeChange(
                id=r["id"],
                job=r["job"],
                version=r["version"],
                kind=r["kind"],
                urgent=bool(r["urgent"]),
                status=r["status"],
                requested_ms=r["requested_ms"],
                applied_ms=r["applied_ms"],
                decision_id=r["decision_id"],
                reason=r["reason"],
            )
            for r in rows
        ]

    def version_stack(self, job: str) -> list[str]:
        """Versions the job went through, oldest first, with rolled-back ones popped.

        The current version is the last; a rollback goes to the one before it.
        """
        stack: list[str] = []
        for ch in self.code_changes(job):
            if ch.status != "applied":
                continue
            if ch.kind == "rollback":
                while stack and stack[-1] != ch.version:
                    stack.pop()
                if not stack:
                    stack.append(ch.version)
            else:
                stack.append(ch.version)
        return stack

    def pending_updates(self, job: str | None = None) -> list[CodeChange]:
        if job is None:
            rows = self._rows("SELECT DISTINCT job FROM code_changes WHERE status = 'pending'")
            return [ch for r in rows for ch in self.pending_updates(r["job"])]
        return [ch for ch in self.code_changes(job) if ch.status == "pending"]

    # --- job specs -------------------------------------------------------------------------------

    def save_spec(self, spec: JobSpec) -> bool:
        """Keep ``spec`` if it is newer than the known one for its job (raises, storing nothing, for a
        spec that could not be read back: see :meth:`accept`)."""
        raw = _readable(spec, JobSpec)
        with self._tx() as c:
            row = c.execute("SELECT ts_ms FROM specs WHERE job = ?", (spec.job,)).fetchone()
            if row is not None and row[0] > spec.ts_ms:
                return False
            c.execute(
                "INSERT INTO specs (job, ts_ms, spec) VALUES (?, ?, ?) ON CONFLICT (job) DO UPDATE"
                " SET ts_ms = excluded.ts_ms, spec = excluded.spec",
                (spec.job, spec.ts_ms, raw),
            )
            return True

    def spec(self, job: str) -> JobSpec | None:
        rows = self._rows("SELECT spec FROM specs WHERE job = ?", (job,))
        if not rows:
            return None
        spec = decode(rows[0]["spec"], expect=JobSpec)
        assert isinstance(spec, JobSpec)
        return spec
