"""The demo's two jobs on one host each get CPUs of their own: CPU lists, the split, and a real
spawned process pinned (and not pinned) as asked."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from trainguard_demo.launcher import CPUS_ENV, _spawn, cluster_cpus, parse_cpus
from trainguard_demo.run import split_cpus


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("", set()), ("0", {0}), ("0-3", {0, 1, 2, 3}), ("0,2", {0, 2}), ("1-2, 5", {1, 2, 5}), ("3,", {3})],
)
def test_cpu_lists(text: str, cpus: set[int]) -> None:
    assert parse_cpus(text) == cpus


@pytest.mark.parametrize("text", ["a", "1-", "3-1", "-2", "0;1"])
def test_bad_cpu_lists_are_errors(text: str) -> None:
    with pytest.raises(ValueError, match="CPU"):
        parse_cpus(text)


def test_split_gives_disjoint_halves_or_nothing() -> None:
    assert split_cpus({0, 1}) == ({0}, {1})
    assert split_cpus({4, 5, 6, 7}) == ({4, 5}, {6, 7})
    assert split_cpus({0}) == (frozenset(), frozenset())
    assert split_cpus(set()) == (frozenset(), frozenset())


def test_cluster_cpus_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPUS_ENV, "0")
    assert cluster_cpus() == {0}
    monkeypatch.delenv(CPUS_ENV)
    assert cluster_cpus() == frozenset()


def _affinity_of_spawned(tmp_path: Path, cpus: frozenset[int] | None) -> set[int]:
    # The child reports its own affinity once its parent has had the time to set it.
    code = "import json, os, time; time.sleep(0.5); print(json.dumps(sorted(os.sched_getaffinity(0))))"
    proc = _spawn([sys.executable, "-c", code], tmp_path / "out", tmp_path / "err", dict(os.environ), cpus)
    assert proc.wait(timeout=30) == 0, (tmp_path / "err").read_text()
    return set(json.loads((tmp_path / "out").read_text()))


def test_a_spawned_process_is_pinned_to_the_cpus_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = os.sched_getaffinity(0)
    one = min(host)
    monkeypatch.setenv(CPUS_ENV, str(one))
    assert _affinity_of_spawned(tmp_path / "env", None) == {one}  # from the environment
    assert _affinity_of_spawned(tmp_path / "none", frozenset()) == host  # explicitly not pinned
    # CPUs the host lacks are left out; none left at all: not pinned rather than an error.
    assert _affinity_of_spawned(tmp_path / "gone", frozenset({one, 4096})) == {one}
    assert _affinity_of_spawned(tmp_path / "all-gone", frozenset({4096})) == host
