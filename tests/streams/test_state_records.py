"""State records too big for Kafka: compressed, and never a crash (the 2,400-machine load bench
crashed the worker on a 19,200-rank job's 1.05 MB monitor record)."""

from __future__ import annotations

import doctest
import json
import zlib

import pytest

import trainguard.streams.state
from trainguard.detectors.keyed_state import PathState
from trainguard.detectors.replay import ReplayConfig
from trainguard.detectors.routing import TRAINING, DetectionPath
from trainguard.detectors.state import StateError
from trainguard.schemas.workload import TrainingStep
from trainguard.streams.state import MAX_RECORD_BYTES, pack_record, unpack_record


def test_docstring_examples() -> None:
    assert doctest.testmod(trainguard.streams.state).failed == 0


def test_a_19200_rank_monitor_fits_in_one_record_once_compressed() -> None:
    path = DetectionPath(ReplayConfig())
    for rank in range(19_200):
        ev = TrainingStep(job="big", rank=rank, step=100, ts_ms=1_000 + rank, node=f"node-{rank // 8:05d}")
        path.findings(TRAINING, ev, 2_000)
    doc = PathState(path).snapshot(TRAINING, "big")
    raw = json.dumps({"p": 0, "o": {"steps": 1}, "s": doc}).encode()
    assert len(raw) > 1_000_000  # what the worker used to send, and Kafka refused
    packed = pack_record(raw)
    assert len(packed) < MAX_RECORD_BYTES // 2
    assert unpack_record(packed) == raw


def test_a_bad_or_inflating_record_is_a_state_error() -> None:
    with pytest.raises(StateError):
        unpack_record(b"Znot zlib at all")
    bomb = b"Z" + zlib.compress(b"0" * (70 * 1024 * 1024), 9)
    with pytest.raises(StateError, match="inflates past"):
        unpack_record(bomb)
