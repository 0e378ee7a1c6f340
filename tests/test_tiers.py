"""The tier each test lands in (tests/conftest.py ``tier_of``), from what a test uses and where it lives."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest

from tests.conftest import TESTS, TIERS, tier_of


@dataclass
class CallSpec:
    params: dict[str, Any]


@dataclass
class Item:
    """What ``tier_of`` reads of a collected item: markers closest first, fixtures, params, path."""

    path: Path
    fixturenames: list[str] = field(default_factory=list)
    marks: list[str] = field(default_factory=list)
    callspec: CallSpec | None = None

    def iter_markers(self) -> Iterator[pytest.Mark]:
        return (getattr(pytest.mark, name).mark for name in self.marks)

    def get_closest_marker(self, name: str) -> pytest.Mark | None:
        return next((m for m in self.iter_markers() if m.name == name), None)


def tier(path: str, fixtures: tuple[str, ...] = (), marks: tuple[str, ...] = (), **params: Any) -> str:
    item = Item(TESTS / path, list(fixtures), list(marks), CallSpec(params) if params else None)
    return tier_of(cast(pytest.Item, item))


def test_no_server_is_unit_wherever_it_lives() -> None:
    assert tier("schemas/test_codec.py", ("tmp_path",)) == "unit"
    assert tier("demo/test_units.py") == "unit"
    assert tier("actions/test_slurm_names.py") == "unit"
    assert tier("infra/test_store.py", ("store",), store="chdb") == "unit"  # chDB runs in-process
    assert tier("../trainguard/schemas/codec.py") == "unit"  # a doctest


def test_the_real_servers_are_integration() -> None:
    assert tier("streams/test_worker.py", ("worker", "stack_settings")) == "integration"
    assert tier("infra/test_store.py", ("store",), store="clickhouse-18.16") == "integration"
    assert tier("infra/test_stack.py", ("tmp_path",), ("slow",)) == "integration"


def test_clusters_demos_and_benchmarks_on_servers_are_e2e() -> None:
    assert tier("actions/test_k8s_executor.py", ("k8s_cluster",)) == "e2e"
    assert tier("infra/test_anything.py", ("slurm_cluster", "stack_settings")) == "e2e"
    assert tier("demo/test_faults.py", (), ("slow",)) == "e2e"
    assert tier("bench/test_chaos.py", ("chaos",), ("slow",)) == "e2e"
    assert tier("infra/test_slurm_stack.py", ("tmp_path",), ("slow",)) == "e2e"
    assert tier("infra/test_k8s_lease.py", ("stack_settings",)) == "e2e"


def test_the_closest_explicit_tier_wins() -> None:
    assert tier("demo/test_faults.py", (), ("integration", "slow")) == "integration"
    assert tier("streams/test_worker.py", ("k8s_cluster",), ("unit",)) == "unit"
    # A function's marker before its module's: iter_markers yields the closest first.
    assert tier("infra/test_x.py", ("stack_settings",), ("e2e", "integration")) == "e2e"


def test_the_tiers_are_registered() -> None:
    text = (TESTS.parent / "pyproject.toml").read_text()
    assert all(f'"{name}: ' in text for name in TIERS)
