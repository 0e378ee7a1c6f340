"""Every named query, the report's data and the postmortem's ETTR, unchanged, on the replicated cluster.

The tests of ``test_named_queries``, ``test_report`` and ``test_postmortem`` that take a ``store``
run here again with ``store`` a fresh database of the cluster stack: migrated ``ON CLUSTER``,
queried through the ``Distributed`` tables under the names the queries use (``FINAL`` included),
written through them as the sink writes.  Their assertions are the single server's, untouched.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace

import pytest

from tests.cluster_fixture import cluster_settings as cluster_settings  # the module's private cluster

# Collected here again, on the cluster (``x as x``: the fixtures and tests this module re-uses).
from tests.infra.test_named_queries import incidents_store as incidents_store
from tests.infra.test_named_queries import test_dead_letters as test_dead_letters
from tests.infra.test_named_queries import test_detection_latency as test_detection_latency
from tests.infra.test_named_queries import test_ettr_and_training_curve as test_ettr_and_training_curve
from tests.infra.test_named_queries import (
    test_every_query_runs_on_an_empty_database as test_every_query_runs_on_an_empty_database,
)
from tests.infra.test_named_queries import (
    test_incident_steps_evictions_and_standbys as test_incident_steps_evictions_and_standbys,
)
from tests.infra.test_named_queries import test_incidents_and_mttr_agree as test_incidents_and_mttr_agree
from tests.infra.test_named_queries import test_loader_takeovers as test_loader_takeovers
from tests.infra.test_named_queries import test_machines_view as test_machines_view
from tests.infra.test_named_queries import test_node_checks as test_node_checks
from tests.infra.test_postmortem import (
    test_ettr_counts_recomputed_steps_and_downtime_as_unproductive as test_ettr_counts_recomputed_steps_and_downtime_as_unproductive,
)
from tests.infra.test_postmortem import (
    test_incident_timeline_joins_detection_decision_and_actions as test_incident_timeline_joins_detection_decision_and_actions,
)
from tests.infra.test_report import report_store as report_store
from tests.infra.test_report import (
    test_report_data_from_the_named_queries as test_report_data_from_the_named_queries,
)
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.config import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def store(cluster_settings: Settings) -> Iterator[ClickHouseStore]:
    """A migrated store in a fresh database of the cluster (replaces conftest's ``store``)."""
    db = f"tgtest_{uuid.uuid4().hex[:10]}"
    st = ClickHouseStore(replace(cluster_settings.clickhouse, database=db))
    assert st.cfg.cluster, "the cluster fixture must configure clickhouse.cluster"
    st.migrate()
    yield st
    st.command(f"DROP DATABASE IF EXISTS {db} ON CLUSTER {st.cfg.cluster}")
    st.close()
