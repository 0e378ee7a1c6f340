"""The Slurm executor builds no path outside its state directory from a job name (fast: no Slurm).

Names are refused at decode (``tests/schemas/test_names.py``); these specs are built in Python,
past the codec, to show the executor's own check: a name that is a path, or a state directory
entry a link makes point elsewhere, is a :class:`PermanentError` and nothing is written outside.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.actions.slurm_fixture import ctx
from trainguard.actions.errors import PermanentError
from trainguard.actions.executors.base import ExecutorEnv
from trainguard.actions.executors.slurm import SlurmExecutor, SlurmExecutorConfig
from trainguard.schemas.control import JobSpec
from trainguard.schemas.topology import JobTopology


def executor(state: Path, **cfg: object) -> SlurmExecutor:
    return SlurmExecutor(SlurmExecutorConfig(slurm_conf="/nonexistent", **cfg), ExecutorEnv(state_dir=state))  # type: ignore[arg-type]


def spec_of(job: str) -> JobSpec:
    topo = JobTopology(job="j", tp=1, pp=1, dp=1, ranks_per_machine=1, machines=["n1"])
    return JobSpec(job=job, ts_ms=1, topology=topo)


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


@pytest.mark.parametrize("job", ["../../outside", "..", "a/b", "-rf", "x" * 300, ".hidden"])
def test_a_job_name_that_is_a_path_builds_no_file(tmp_path: Path, job: str) -> None:
    state = tmp_path / "state"
    ex = executor(state)
    before = files_under(tmp_path)
    with pytest.raises(PermanentError, match="no file is named after it"):
        ex.hot_update(spec_of(job), "v2", ctx("hot_update"))
    with pytest.raises(PermanentError, match="no file is named after it"):
        ex._remember(spec_of(job), "42")
    assert files_under(tmp_path) == before


def test_a_template_version_file_takes_a_checked_name_only(tmp_path: Path) -> None:
    ex = executor(tmp_path / "state", version_file=str(tmp_path / "versions" / "{job}.txt"))
    ex.hot_update(spec_of("llm-7b.v2"), "v2", ctx("hot_update"))
    assert (tmp_path / "versions" / "llm-7b.v2.txt").read_text() == "v2\n"
    with pytest.raises(PermanentError, match="holds '/'"):
        ex.hot_update(spec_of("../escaped"), "v2", ctx("hot_update"))
    assert not (tmp_path / "escaped.txt").exists()


def test_a_linked_job_directory_is_not_followed_out(tmp_path: Path) -> None:
    """Defence in depth: were ``<state>/slurm/<job>`` a link elsewhere, nothing goes through it."""
    state, outside = tmp_path / "state", tmp_path / "outside"
    ex = executor(state)
    outside.mkdir()
    (state / "slurm" / "llm").symlink_to(outside)
    with pytest.raises(PermanentError, match="is not inside"):
        ex.hot_update(spec_of("llm"), "v2", ctx("hot_update"))
    assert list(outside.iterdir()) == []


def test_a_valid_name_writes_its_files_inside(tmp_path: Path) -> None:
    ex = executor(tmp_path / "state")
    ex.hot_update(spec_of("llm"), "v2", ctx("hot_update"))
    ex._remember(spec_of("llm"), "42")
    assert (tmp_path / "state" / "slurm" / "llm" / "code_version").read_text() == "v2\n"
    assert (tmp_path / "state" / "slurm" / "llm.json").is_file()
