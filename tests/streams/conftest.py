"""A shared real worker for the stream integration tests (thresholds shortened for test time)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.net import free_port
from tests.streams.harness import WorkerProcess, unique
from trainguard.infra.config import Settings

#: Short thresholds so a stall is a hang after 4 s instead of 10 minutes.
FAST_ENV = {
    "TRAINGUARD__WORKER__MONITOR__STALL__STALL_S": "4",
    # A silent machine (3 of its 1 s liveness intervals) is found before that stall.
    "TRAINGUARD__WORKER__MONITOR__LIVENESS__MIN_SILENCE_S": "2",
    "TRAINGUARD__WORKER__CHECK_INTERVAL_S": "1",
    "TRAINGUARD__WORKER__AGGREGATION__DEADLINE_S": "6",
    "TRAINGUARD__WORKER__AGGREGATION__COOLDOWN_S": "0",
    "TRAINGUARD__WORKER__SINK__MAX_WAIT_S": "0.3",
}


@pytest.fixture(scope="module")
def worker(stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    log = Path(tmp_path_factory.mktemp("worker")) / "worker.log"
    w = WorkerProcess(unique("tg-test"), free_port(), log, FAST_ENV, stack_settings).start()
    yield w
    w.stop()
