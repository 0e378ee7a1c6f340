"""The Flight Recorder analysis on dumps recorded from real gloo jobs (``scripts/capture_fr_fixtures.py``:
8 and 16 ranks, a healthy job and one per injected fault), in both of PyTorch's formats."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.detectors.fr_fixtures import analyze_case, cases

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "flight_recorder"
CASES = cases(FIXTURES)


def _analyze(name: str, fmt: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return analyze_case(FIXTURES, name, fmt)


def test_there_are_fixtures_at_8_and_16_ranks() -> None:
    sizes = {json.loads((FIXTURES / c / "manifest.json").read_text())["topology"]["dp"] for c in CASES}
    assert sizes == {2, 4} and len(CASES) >= 10


@pytest.mark.parametrize("fmt", ["pickle", "json"])
@pytest.mark.parametrize("name", CASES)
def test_recorded_dumps_get_the_expected_verdict(name: str, fmt: str) -> None:
    manifest, out = _analyze(name, fmt)
    expected = manifest["expected"]
    assert out["verdict"] == expected["verdict"], out["evidence"]["reason"]
    assert out["evict"]["kind"] == expected["kind"]
    if manifest["faulty_rank"] is not None:
        # The faulty rank's group goes; the suspect is the faulty rank, or (gloo records no
        # point-to-point operations) the rank its skipped send left waiting, in the same pipeline.
        assert manifest["faulty_rank"] in out["evict"]["ranks"]
        assert expected["suspect"] in out["suspect_ranks"], out["evidence"]["reason"]
    assert out["evidence"]["undumped_ranks"] == manifest["not_dumped"]


@pytest.mark.parametrize("name", CASES)
def test_both_formats_agree(name: str) -> None:
    a, b = _analyze(name, "pickle")[1], _analyze(name, "json")[1]
    assert (a["verdict"], a["suspect_ranks"], a["evict"]) == (b["verdict"], b["suspect_ranks"], b["evict"])
