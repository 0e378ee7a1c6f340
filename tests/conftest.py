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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Store tests on the real server are integration tests: mark them slow like the others.
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("store") == "clickhouse-18.16":
            item.add_marker(pytest.mark.slow)
