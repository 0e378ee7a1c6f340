"""``dcgm`` and ``nccl-tests``: their parsers on sample output (tests/diag/fixtures, written for
these tests in each tool's documented layout), and their runners against stand-in executables
placed on PATH in a temporary directory.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from trainguard.diag import DiagContext, load_diag_config, run_test
from trainguard.diag.dcgm import parse_dcgmi_diag
from trainguard.diag.nccl_tests import parse_nccl_tests

FIXTURES = Path(__file__).parent / "fixtures"


def fake_tool(bin_dir: Path, name: str, output: str, rc: int = 0, sleep_s: float = 0.0) -> Path:
    """An executable ``name`` in ``bin_dir`` that prints ``output`` (and its argv to argv.txt)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / f"{name}.out").write_text(output)
    script = bin_dir / name
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > "{bin_dir}/argv.txt"\n'
        f"sleep {sleep_s}\n"
        f'cat "{bin_dir}/{name}.out"\n'
        f"exit {rc}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def ctx_on_path(bin_dir: Path, **sections: Any) -> DiagContext:
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin"}
    return DiagContext(cfg=load_diag_config("quick", sections, environ={}), env=env)


# -- dcgmi diag -------------------------------------------------------------------------------------


def test_dcgmi_table_all_pass() -> None:
    report = parse_dcgmi_diag((FIXTURES / "dcgmi_diag_r1_pass.txt").read_text())
    assert report.metadata == {
        "DCGM Version": "3.3.9",
        "Driver Version Detected": "550.90.07",
        "GPU Device IDs Detected": "2330,2330",
    }
    assert [t.name for t in report.tests][:3] == ["Denylist", "NVML Library", "CUDA Main Library"]
    assert {t.category for t in report.tests} == {"Deployment"}
    assert [t.status for t in report.tests].count("pass") == 8
    assert report.tests[-1].name == "Inforom" and report.tests[-1].status == "skip"


def test_dcgmi_table_with_a_failed_gpu_and_a_warning() -> None:
    report = parse_dcgmi_diag((FIXTURES / "dcgmi_diag_r2_fail.txt").read_text())
    by_name = {t.name: t for t in report.tests}
    mem = by_name["GPU Memory"]
    assert (mem.category, mem.status) == ("Hardware", "fail")
    assert mem.results == [("pass", "GPUs: 0, 1, 3"), ("fail", "GPU: 2")]
    # the wrapped detail row is joined to the one it continues
    assert mem.details == [
        "Warning: GPU 2: Error using CUDA API cudaMalloc: an illegal m emory access was encountered"
    ]
    persistence = by_name["Persistence Mode"]
    assert persistence.status == "warn" and persistence.details[0].startswith("Warning: Persistence mode")
    assert by_name["PCIe"].results == [("pass", "All")] and by_name["PCIe"].category == "Integration"
    assert by_name["Diagnostic"].status == "skip" and by_name["Diagnostic"].category == "Stress"
    assert len(report.tests) == 12


def test_dcgm_runner_against_a_fake_dcgmi(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    fake_tool(bin_dir, "dcgmi", (FIXTURES / "dcgmi_diag_r2_fail.txt").read_text())
    res = run_test("dcgm", ctx_on_path(bin_dir, dcgm={"run_level": 2}))
    assert (bin_dir / "argv.txt").read_text().split() == ["diag", "-r", "2"]
    assert res.passed is False
    assert res.findings == [
        "dcgm Hardware / GPU Memory: fail (GPU: 2): Warning: GPU 2: Error using CUDA API cudaMalloc: "
        "an illegal m emory access was encountered"
    ]  # the Warn of Persistence Mode does not fail the test by default ...
    assert res.measured["metadata"]["DCGM Version"] == "3.3.9" and len(res.measured["tests"]) == 12
    # ... and does with fail_on_warn
    res = run_test("dcgm", ctx_on_path(bin_dir, dcgm={"run_level": 2, "fail_on_warn": True}))
    assert len(res.findings) == 2 and res.findings[0].startswith("dcgm Deployment / Persistence Mode: warn")


def test_dcgm_runner_passes_skips_and_fails(tmp_path: Path) -> None:
    ok = tmp_path / "ok"
    fake_tool(ok, "dcgmi", (FIXTURES / "dcgmi_diag_r1_pass.txt").read_text())
    res = run_test("dcgm", ctx_on_path(ok))
    assert res.passed is True and res.measured["command"][1:] == ["diag", "-r", "1"]

    res = run_test("dcgm", ctx_on_path(tmp_path / "empty"))
    assert res.passed is None and str(res.skipped_reason).startswith("dcgmi not installed (not on PATH)")

    no_engine = tmp_path / "no-engine"
    fake_tool(
        no_engine,
        "dcgmi",
        "Error: unable to establish a connection to the specified host: localhost\n",
        rc=255,
    )
    res = run_test("dcgm", ctx_on_path(no_engine))
    assert res.passed is None and "cannot reach nv-hostengine" in str(res.skipped_reason)

    garbage = tmp_path / "garbage"
    fake_tool(garbage, "dcgmi", "Segmentation fault\n", rc=139)
    res = run_test("dcgm", ctx_on_path(garbage))
    assert res.passed is False and "gave no results (exit 139)" in res.findings[0]

    slow = tmp_path / "slow"
    fake_tool(slow, "dcgmi", "", sleep_s=5)
    res = run_test("dcgm", ctx_on_path(slow, dcgm={"timeout_s": 0.5}))
    assert res.passed is False and "did not finish within 0.5 s" in res.findings[0]


# -- all_reduce_perf --------------------------------------------------------------------------------


def test_nccl_tests_table() -> None:
    report = parse_nccl_tests((FIXTURES / "all_reduce_perf_2gpu.txt").read_text())
    assert [r.size for r in report.rows] == [8388608 << i for i in range(5)]
    first = report.rows[0]
    assert (first.count, first.type, first.redop) == (2097152, "float", "sum")
    assert first.results["out_of_place"] == {
        "time_us": 61.2,
        "algbw_gbps": 137.07,
        "busbw_gbps": 137.07,
        "wrong": 0,
    }
    assert report.out_of_bounds == 0 and report.avg_busbw_gbps == pytest.approx(182.369)
    assert report.peak_busbw_gbps == pytest.approx(209.81)
    assert report.wrong_rows() == [(67108864, "in_place", 3)]


def test_nccl_tests_older_layout_without_root_and_with_error_column() -> None:
    report = parse_nccl_tests((FIXTURES / "all_reduce_perf_old_format.txt").read_text())
    assert len(report.rows) == 4 and report.rows[0].results["in_place"]["error"] == pytest.approx(5e-7)
    assert report.wrong_rows() == []  # a rounding error is not a wrong element ...
    assert report.out_of_bounds == 2  # ... values past the tolerance are counted here
    assert report.peak_busbw_gbps == pytest.approx(48.03)


def test_nccl_tests_validation_off_and_noise() -> None:
    text = (
        "#  size  count  type redop root  time algbw busbw #wrong  time algbw busbw #wrong\n"
        "node07:4242:4242 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.7<0>\n"
        "  1024    256 float   sum   -1  9.10  0.11  0.11    N/A  9.00  0.11  0.11    N/A\n"
    )
    report = parse_nccl_tests(text)
    assert len(report.rows) == 1 and report.rows[0].results["out_of_place"]["wrong"] is None
    assert parse_nccl_tests("no table here\n").rows == []


def test_nccl_tests_runner_against_a_fake_binary(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    fake_tool(bin_dir, "all_reduce_perf", (FIXTURES / "all_reduce_perf_2gpu.txt").read_text())
    ctx = ctx_on_path(bin_dir, nccl_tests={"gpus": 2, "expected_busbw_gbps": 300.0})
    res = run_test("nccl-tests", ctx)
    assert (bin_dir / "argv.txt").read_text().split() == ["-b", "8M", "-e", "1G", "-f", "2", "-g", "2"]
    assert res.passed is False
    assert res.findings == [
        "all_reduce of 67108864 B (in-place): 3 wrong element(s)",
        "peak bus bandwidth 209.8 GB/s < 240.0 (0.8 x the expected 300)",
    ]
    assert res.measured["peak_busbw_gbps"] == pytest.approx(209.81) and len(res.measured["rows"]) == 5

    old = tmp_path / "old"
    fake_tool(old, "all_reduce_perf", (FIXTURES / "all_reduce_perf_old_format.txt").read_text())
    res = run_test("nccl-tests", ctx_on_path(old, nccl_tests={"gpus": 4}))
    assert res.findings == ["2 out-of-bounds value(s)"]

    res = run_test("nccl-tests", ctx_on_path(tmp_path / "none", nccl_tests={"gpus": 2}))
    assert res.passed is None and str(res.skipped_reason).startswith("all_reduce_perf not installed")

    crash = tmp_path / "crash"
    fake_tool(
        crash, "all_reduce_perf", "node07: Test NCCL failure common.cu:1005 'unhandled system error'\n", rc=1
    )
    res = run_test("nccl-tests", ctx_on_path(crash, nccl_tests={"gpus": 2}))
    assert res.passed is False and res.findings[0].startswith(
        "all_reduce_perf exited with 1: node07: Test NCCL failure"
    )
