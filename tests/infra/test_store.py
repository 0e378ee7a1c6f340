"""The ClickHouse store on both engines: migrations, every table, dedup, queries, retention."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, date, datetime, timedelta

import pytest

from tests.infra.events import one_of_each
from trainguard.infra.clickhouse.rows import TABLES
from trainguard.infra.clickhouse.store import ClickHouseStore, StoreError, load_migrations
from trainguard.schemas.base import now_ms
from trainguard.schemas.workload import TrainingStep


def test_migrations_are_recorded_and_idempotent(store: ClickHouseStore) -> None:
    assert store.migrate() == []  # the fixture already applied them
    applied = store.applied_migrations()
    assert sorted(applied) == [m.version for m in load_migrations()]
    tables = {
        r[0]
        for r in store.query(
            "SELECT name FROM system.tables WHERE database = %(d)s", {"d": store.cfg.database}
        )
    }
    assert {t for t, _ in TABLES.values()} <= tables


def test_a_changed_migration_is_refused(store: ClickHouseStore) -> None:
    store.insert_rows(
        "schema_migrations",
        [
            {
                "version": 1,
                "name": "telemetry",
                "checksum": "tampered",
                "applied_at": datetime.now(tz=UTC).replace(microsecond=0) + timedelta(seconds=5),
            }
        ],
    )
    with pytest.raises(StoreError, match="changed after it was applied"):
        store.migrate()


def test_every_event_type_lands_and_redelivery_does_not_double(store: ClickHouseStore) -> None:
    job = f"j{uuid.uuid4().hex[:6]}"
    events = one_of_each(job, now_ms())
    first = store.insert_events(events)
    second = store.insert_events(events)  # at-least-once redelivery / replay
    assert first == second and set(first) == {t for t, _ in TABLES.values()}
    for table, n in first.items():
        assert store.count(table) == n, table


def test_recomputed_steps_are_kept_but_duplicates_collapse(store: ClickHouseStore) -> None:
    t0 = now_ms()
    run1 = [TrainingStep(job="j", rank=0, step=s, ts_ms=t0 + s, loss=1.0) for s in range(10)]
    # Restart from the checkpoint at step 5: steps 5..9 are recomputed later (new ts_ms).
    run2 = [TrainingStep(job="j", rank=0, step=s, ts_ms=t0 + 1000 + s, loss=0.9) for s in range(5, 10)]
    store.insert_events(run1 + run2 + run1)
    assert store.count("training_steps") == 15
    rows = store.query("SELECT count() AS n, uniqExact(step) FROM training_steps FINAL WHERE job = 'j'")
    assert rows[0] == (15, 10)


def test_postmortem_queries_run_on_this_engine(store: ClickHouseStore) -> None:
    t0 = now_ms()
    steps = [
        TrainingStep(
            job="pm",
            rank=r,
            step=s,
            ts_ms=t0 + s * 1000 + r,
            loss=5.0 - s * 0.1,
            step_time_s=1.0 + (0.5 if r == 2 else 0.0),
        )
        for r in range(4)
        for s in range(20)
    ]
    store.insert_events(steps)
    last = store.query(
        "SELECT rank, max(step), argMax(loss, step) FROM training_steps FINAL WHERE job = %(j)s "
        "GROUP BY rank ORDER BY rank",
        {"j": "pm"},
    )
    assert [r[1] for r in last] == [19] * 4
    slow = store.query(
        "SELECT rank, quantile(0.5)(step_time_s) AS p50 FROM training_steps FINAL WHERE job = %(j)s "
        "GROUP BY rank ORDER BY p50 DESC LIMIT 1",
        {"j": "pm"},
    )
    assert slow[0][0] == 2
    latest = store.query_dicts(
        "SELECT rank, step FROM training_steps FINAL WHERE job = %(j)s ORDER BY step DESC LIMIT 1 BY rank",
        {"j": "pm"},
    )
    assert sorted(d["rank"] for d in latest) == [0, 1, 2, 3]
    per_minute = store.query(
        "SELECT toStartOfMinute(ts) AS m, count() FROM training_steps FINAL WHERE job = %(j)s GROUP BY m",
        {"j": "pm"},
    )
    assert sum(r[1] for r in per_minute) == 80


def test_prune_drops_only_old_daily_partitions(store: ClickHouseStore) -> None:
    old = int((time.time() - 30 * 86400) * 1000)
    store.insert_events(
        [
            TrainingStep(job="old", rank=0, step=1, ts_ms=old),
            TrainingStep(job="new", rank=0, step=1, ts_ms=now_ms()),
        ]
    )
    dropped = store.prune(keep_days=7)
    assert tuple({t for t, _ in dropped}) == ("training_steps",)
    assert store.count("training_steps", "job = 'old'") == 0
    assert store.count("training_steps", "job = 'new'") == 1
    assert store.prune(keep_days=7, today=date.today()) == []


def test_missing_table_is_a_clear_error(store: ClickHouseStore) -> None:
    with pytest.raises(StoreError, match="does not exist"):
        store.insert_rows("no_such_table", [{"a": 1}])
