"""``trainguard diag`` through click's CliRunner: the JSON-lines shape, exit codes, ``--out``,
``--list``, bad flags; its registration as an entry point; and that importing it loads neither
torch nor pynvml.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from importlib import import_module
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from tests.diag.test_external_tools import FIXTURES, fake_tool
from trainguard.commands.diag import diag
from trainguard.diag import LEVEL_TESTS, REGISTRY

ROOT = Path(__file__).resolve().parents[2]
KEYS = ["test", "passed", "skipped_reason", "measured", "thresholds", "duration_s", "findings"]


def _invoke(args: list[str], path: Path) -> tuple[int, list[dict[str, Any]], str]:
    res = CliRunner().invoke(
        diag, args, env={"PATH": f"{path}{os.pathsep}/usr/bin:/bin"}, obj={"quiet": True}
    )
    lines = [json.loads(line) for line in res.stdout.splitlines()] if "--json" in args else []
    return res.exit_code, lines, res.output


def test_json_lines_one_per_test_and_exit_0_when_all_skipped(tmp_path: Path) -> None:
    code, lines, _ = _invoke(["--json", "--test", "dcgm", "--test", "nccl-tests"], tmp_path)
    assert code == 0
    assert [list(line) for line in lines] == [KEYS, KEYS]
    assert [line["test"] for line in lines] == ["dcgm", "nccl-tests"]
    assert all(line["passed"] is None and line["findings"] == [] for line in lines)
    assert lines[0]["skipped_reason"].startswith("dcgmi not installed")
    assert isinstance(lines[0]["duration_s"], float) and lines[0]["thresholds"] == {
        "failing_statuses": ["fail"]
    }


def test_a_failed_test_exits_1_and_out_gets_the_same_lines(tmp_path: Path) -> None:
    fake_tool(tmp_path, "dcgmi", (FIXTURES / "dcgmi_diag_r2_fail.txt").read_text())
    out = tmp_path / "results.jsonl"
    code, lines, _ = _invoke(["--json", "--test", "dcgm,nccl-tests", "--out", str(out)], tmp_path)
    assert code == 1
    assert [(line["test"], line["passed"]) for line in lines] == [("dcgm", False), ("nccl-tests", None)]
    assert [json.loads(line) for line in out.read_text().splitlines()] == lines
    # the level's dcgm run level comes through: standard runs -r 2
    code, lines, _ = _invoke(["--json", "--level", "standard", "--test", "dcgm"], tmp_path)
    assert lines[0]["measured"]["command"][1:] == ["diag", "-r", "2"] and code == 1


def test_human_output_and_list(tmp_path: Path) -> None:
    fake_tool(tmp_path, "dcgmi", (FIXTURES / "dcgmi_diag_r1_pass.txt").read_text())
    code, _, output = _invoke(["--test", "dcgm,nccl-tests"], tmp_path)
    assert code == 0
    assert output.splitlines()[0].startswith("PASS  dcgm")
    assert output.splitlines()[1].startswith("SKIP  nccl-tests") and "all_reduce_perf not installed" in output
    assert "1 passed, 0 failed, 1 skipped" in output

    res = CliRunner().invoke(diag, ["--list"])
    assert res.exit_code == 0
    assert [line.split()[0] for line in res.output.splitlines()] == list(REGISTRY)
    assert "memory       [standard,long]" in res.output


def test_bad_flags_are_usage_errors(tmp_path: Path) -> None:
    cases = [
        (["--test", "gpu-healht"], "unknown test(s) 'gpu-healht'; the tests are: collective, dcgm,"),
        (["--level", "fast"], "'fast' is not one of 'quick', 'standard', 'long'"),
        (["--set", "memory.sise_mib=512"], "DiagConfig.memory: unknown field(s) 'sise_mib'"),
        (["--set", "memory=512"], "'memory=512': expected SECTION.KEY=VALUE"),
        (["--set", "memory.size_mib=lots"], "DiagConfig.memory.size_mib: expected an integer"),
        (["--expected-digest", "abc"], "expected_digest must be a sha256 in hex"),
        (["--set", "collective.backend=mpi"], "backend must be auto, nccl or gloo"),
    ]
    for args, message in cases:
        res = CliRunner().invoke(diag, args)
        assert res.exit_code == 2, (args, res.output)
        assert message in " ".join(res.output.split()), (args, res.output)
    bad_yaml = tmp_path / "diag.yaml"
    bad_yaml.write_text("gemm_digest:\n  sizee: 3\n")
    res = CliRunner().invoke(diag, ["--diag-config", str(bad_yaml)])
    assert res.exit_code == 2 and "DiagConfig.gemm_digest: unknown field(s) 'sizee'" in res.output


def test_every_level_names_registered_tests_only() -> None:
    assert {name for names in LEVEL_TESTS.values() for name in names} == set(REGISTRY)


def test_registered_as_a_trainguard_command() -> None:
    """The CLI finds commands by entry point: pyproject names this one (the installed metadata of a
    checkout is only as new as its last `pip install -e`, so the file is what is checked)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    value = pyproject["project"]["entry-points"]["trainguard.commands"]["diag"]
    module, _, attr = value.partition(":")
    assert getattr(import_module(module), attr) is diag


def test_importing_the_command_loads_neither_torch_nor_pynvml() -> None:
    code = (
        "import sys, trainguard.commands.diag, trainguard.diag; "
        "heavy = [m for m in ('torch', 'pynvml', 'numpy') if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
