"""``bench/own_job.py``: the "protect your own job" guide's lines are what runs, and a small run works.

The guide (``docs/protect-your-job.md``) and the bench cannot drift apart: the bench reads the
guide's ``# own-job:`` blocks and runs them unchanged, the user's script holds exactly the guide's
four lines, and the configuration block is a valid TrainGuard configuration.  The slow test runs
the bench itself, small (a short training, one crash and one hang), on a private stack of its own
(temporary home, free ports: Kafka, ClickHouse and a local Slurm), and checks its verdict.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.actions.slurm_fixture import private_stack_env
from trainguard.infra.config import load_settings

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "own_job.py"
GUIDE = REPO / "docs" / "protect-your-job.md"
SCRIPT = REPO / "bench" / "user_job" / "train_ddp.py"
sys.path.insert(0, str(BENCH.parent))
import own_job  # noqa: E402  (bench/ is a folder of scripts, not a package)


def test_the_guide_has_every_block_the_bench_runs() -> None:
    blocks = own_job.guide_blocks(GUIDE.read_text())
    assert {"script-lines", "submit", "trainguard.yaml", "worker", "actions"} <= blocks.keys()
    assert "trainguard worker" in blocks["worker"] and "trainguard actions run" in blocks["actions"]
    assert "train.sbatch python train_ddp.py" in blocks["submit"]


def test_the_users_script_adds_exactly_the_guides_lines() -> None:
    """Every line the guide says to add is in the script, as written; every line of the script
    that mentions TrainGuard is one of them."""
    added = own_job.guide_blocks(GUIDE.read_text())["script-lines"].splitlines()
    script = SCRIPT.read_text().splitlines()
    assert added and all(line in script for line in added)
    assert [line for line in script if line.endswith("# trainguard") or "# trainguard:" in line] == added


def test_the_guides_configuration_is_valid(tmp_path: Path) -> None:
    """The configuration block loads as TrainGuard's settings (unknown keys would be errors)."""
    path = tmp_path / "trainguard.yaml"
    path.write_text(own_job.guide_blocks(GUIDE.read_text())["trainguard.yaml"])
    settings = load_settings(path, environ={"TRAINGUARD_HOME": str(tmp_path)})
    actions = yaml.safe_load(path.read_text())["actions"]
    assert actions["executor"] == "slurm" and actions["jobs"] == [own_job.JOB]
    assert settings is not None


def test_guide_blocks_refuse_two_blocks_of_one_name() -> None:
    text = "```bash\n# own-job: a\necho 1\n```\n```bash\n# own-job: a\necho 2\n```\n"
    with pytest.raises(ValueError, match="two blocks named 'a'"):
        own_job.guide_blocks(text)


def test_the_verdict_needs_the_culprit_alone_and_training_again() -> None:
    fault = {"fault": "sigkill", "culprit_node": "n2", "blamed_nodes": ["n2"], "trains_again_s": 12.0}
    assert own_job.verdict({"false_evictions": [], "faults": [fault]})
    assert not own_job.verdict({"false_evictions": ["n1"], "faults": [fault]})
    assert not own_job.verdict({"false_evictions": [], "faults": [{**fault, "blamed_nodes": ["n1", "n2"]}]})
    assert not own_job.verdict({"false_evictions": [], "faults": [{**fault, "trains_again_s": None}]})


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_small_run_blames_the_culprits_node_alone(tmp_path: Path) -> None:
    # A stack of its own (6 Slurm nodes: the guide's 5-node allocation and one more).
    env = {**os.environ, **private_stack_env(tmp_path / "home", 6), "TRAINGUARD_PROGRESS": "0"}
    argv = [sys.executable, str(BENCH), "--json", "--train-s", "10", "--settle-s", "5"]
    argv += ["--faults", "sigkill,sigstop", "--out-dir", str(tmp_path / "runs")]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=800)
    except BaseException:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        raise
    finally:
        trainguard = Path(sys.executable).parent / "trainguard"
        subprocess.run([str(trainguard), "stack", "down"], env=env, capture_output=True, timeout=120)
    assert out, err.decode()[-3000:]
    result: dict[str, Any] = json.loads(out)
    why = _evidence(result, err.decode())  # what a failure in CI needs to be understood there
    assert [f["fault"] for f in result["faults"]] == ["sigkill", "sigstop"], why
    assert result["false_evictions"] == [], why
    for f in result["faults"]:
        assert f["blamed_nodes"] == [f["culprit_node"]], why
        assert f["trains_again_s"] is not None, why
    hang = result["faults"][1]
    assert hang["evicted_nodes"] == [hang["culprit_node"]], why  # the suspect's node, not the job
    assert result["ok"] is True and proc.returncode == 0


def _evidence(result: dict[str, Any], stderr: str) -> str:
    """The run's verdict, its decisions, the bench's log and the worker's and the action
    service's warnings: a failed assertion shows what TrainGuard did, not just that it failed."""
    lines = [json.dumps(result, indent=1)[:6000], "--- bench stderr:", stderr[-2000:]]
    run_dir = Path(result.get("run_dir", ""))
    for name in ("worker.log", "actions.log"):
        path = run_dir / name
        if not path.is_file():
            continue
        text = path.read_text(errors="replace").splitlines()
        keep = [
            line
            for line in text
            if any(w in line for w in ("WARNING", "ERROR", "capture", "decision"))
            and "overlapping" not in line
        ]
        lines += [
            f"--- {name} (warnings, errors, captures, decisions):",
            *(line[:400] for line in keep[-60:]),
        ]
    return "\n".join(lines)


def _resolves(cls: Any, path: list[str]) -> bool:
    import dataclasses
    import typing

    for name in path:
        fields = {f.name for f in dataclasses.fields(cls)}
        if name not in fields:
            return False
        cls = typing.get_type_hints(cls)[name]
    return True


def test_every_setting_the_guide_names_exists() -> None:
    """The guide's table of defaults names settings by path (``worker.decide.settle_s``): each is a
    real field of the worker's or the action service's configuration."""
    import re

    from trainguard.actions.config import ActionsConfig
    from trainguard.streams.config import WorkerConfig

    roots = {"worker": WorkerConfig, "actions": ActionsConfig}
    named = re.findall(r"`((?:worker|actions)\.[a-z_.]+)", GUIDE.read_text())
    assert len(named) >= 4
    for path in named:
        root, *rest = path.split(".")
        assert _resolves(roots[root], rest), path
