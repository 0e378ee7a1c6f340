"""Shared fixtures: the real local stack (Kafka + ClickHouse) and stores on both engines.

Integration tests talk to the real servers that ``trainguard stack up`` starts (started here if
they are not running); nothing is mocked.  The same store tests also run on chDB (in-process
modern ClickHouse) so every DDL and query is checked on 18.16 and on 26.x.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.k8s_fixture import k8s_cluster, k8s_job  # noqa: F401 -- one private Kubernetes per session
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.config import Settings, load_settings
from trainguard.infra.stack.manager import Stack

#: the checkout's stack home, as scripts/test.sh sets it: the stack the tests start (or find
#: running) keeps its data in the checkout, not in the user's default home.
CHECKOUT_HOME = Path(__file__).resolve().parent.parent / ".trainguard"


def pytest_configure(config: pytest.Config) -> None:
    # Before any test module loads settings; a TRAINGUARD_HOME given by the caller wins.
    os.environ.setdefault("TRAINGUARD_HOME", str(CHECKOUT_HOME))


@pytest.fixture(scope="session")
def stack_settings() -> Settings:
    """Settings of the running embedded stack (started if needed, idempotent)."""
    settings = load_settings()
    Stack(settings).up()
    return settings


@pytest.fixture(scope="session")
def chdb_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chdb")


@pytest.fixture(params=["clickhouse-18.16", "chdb"])
def store(request: pytest.FixtureRequest) -> Iterator[ClickHouseStore]:
    """A migrated store in a fresh database, on the embedded server and on chDB."""
    db = f"tgtest_{uuid.uuid4().hex[:10]}"
    if request.param == "chdb":
        cfg = replace(
            load_settings(environ={}).clickhouse,
            dsn=f"chdb://{request.getfixturevalue('chdb_dir')}",
            database=db,
        )
    else:
        cfg = replace(request.getfixturevalue("stack_settings").clickhouse, database=db)
    st = ClickHouseStore(cfg)
    st.migrate()
    yield st
    st.command(f"DROP DATABASE IF EXISTS {db}")
    st.close()


#: The three tiers, fastest first; ``scripts/test.sh -m unit`` is the quick one (docs/testing.md).
TIERS = ("unit", "integration", "e2e")
#: Fixtures that start a whole cluster of the test's own: a Slurm or a Kubernetes control plane.
E2E_FIXTURES = frozenset({"slurm_cluster", "k8s_cluster", "k8s_job"})
#: Fixtures that reach the real local servers (``stack_settings`` starts the stack if it is down);
#: every fixture built on one (``worker``, ``start_service``, ...) has it in its closure.
SERVER_FIXTURES = frozenset({"stack_settings"})
#: Where a test on real servers is end-to-end: the demo's and the benchmarks' folders under tests/,
#: or a module named for a demo, a chaos run, Slurm, Kubernetes or the own-job run.
E2E_FOLDERS = frozenset({"demo", "bench"})
E2E_WORDS = ("demo", "chaos", "slurm", "k8s", "own_job")
TESTS = Path(__file__).resolve().parent


def tier_of(item: pytest.Item) -> str:
    """The tier an item runs in: its closest explicit tier marker, else one inferred.

    A test that needs no server (no ``stack_settings`` in its fixture closure, not on the real
    ClickHouse, not marked ``slow``) is ``unit``; one that starts a Slurm or Kubernetes cluster, or
    that needs servers and lives with the demo or the benchmarks (or is named for one of
    :data:`E2E_WORDS`), is ``e2e``; any other test on servers is ``integration``.
    """
    for mark in item.iter_markers():  # closest first: function, class, module
        if mark.name in TIERS:
            return mark.name
    fixtures = set(getattr(item, "fixturenames", ()))
    if fixtures & E2E_FIXTURES:
        return "e2e"
    callspec = getattr(item, "callspec", None)
    on_server = callspec is not None and callspec.params.get("store") == "clickhouse-18.16"
    if not (on_server or fixtures & SERVER_FIXTURES or item.get_closest_marker("slow")):
        return "unit"
    path = item.path.resolve()
    folder = path.relative_to(TESTS).parts[0] if path.is_relative_to(TESTS) else ""
    if folder in E2E_FOLDERS or any(word in path.stem for word in E2E_WORDS):
        return "e2e"
    return "integration"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        # Store tests on the real server are integration tests: mark them slow like the others.
        if callspec is not None and callspec.params.get("store") == "clickhouse-18.16":
            item.add_marker(pytest.mark.slow)
        tier = tier_of(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(tier)
