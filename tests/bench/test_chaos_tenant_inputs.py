"""What the chaos suite's tenant scenarios throw (``bench/chaos_tenant.py``) is what they claim, and
the in-process half of ``name_injection`` holds (fast: no stack; the scenarios themselves run in
``test_chaos.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the suite's own imports

from chaos_tenant import (
    _executor_checks,
    _files_named,
    _injected,
    hostile_names,
    memo_bomb,
    set_bomb,
)

from trainguard.detectors.flight_recorder import FlightRecorderError, parse_dump
from trainguard.schemas.codec import DecodeError, decode, encode

MARKER, VICTIM = "tgescape0123", "chaos-ni-victim"


def test_the_bombs_are_what_the_scenario_says_and_are_refused() -> None:
    bomb = memo_bomb()
    assert 55_000 < len(bomb) < 60_000
    with pytest.raises(FlightRecorderError, match="expands beyond its budget"):
        parse_dump(bomb, 5, "rank_5")
    with pytest.raises(FlightRecorderError, match="memory budget"):
        parse_dump(set_bomb(256 * 1024), 6, "rank_6")


@pytest.mark.parametrize("name", hostile_names(MARKER, VICTIM), ids=repr)
def test_every_injected_record_is_refused_at_decode_naming_the_name(name: str) -> None:
    for topic, ev in _injected(name, VICTIM):
        with pytest.raises(DecodeError, match=r"name|object key"):
            decode(encode(ev), expect=topic.event)


def test_the_same_records_with_a_real_name_decode() -> None:
    for topic, ev in _injected(f"{VICTIM}-n7", VICTIM):
        assert type(decode(encode(ev), expect=topic.event)) is topic.event


def test_the_executors_refuse_every_name_and_keep_labels_apart(tmp_path: Path) -> None:
    names = hostile_names(MARKER, VICTIM)
    checks = _executor_checks(tmp_path, names)
    assert checks["slurm_paths_refused"] == checks["slurm_names_tried"] == len(names)
    assert checks["k8s_old_label_collisions"] == 3 and checks["k8s_label_collisions"] == 0
    assert _files_named([tmp_path.parent], MARKER, tmp_path) == []
