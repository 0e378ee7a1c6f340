"""``trainguard exporter --once --print`` and the command-line validation (CliRunner)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from trainguard_demo.commands import demo_exporter

from trainguard.commands.exporter import COMMANDS, exporter


def test_commands_exposed() -> None:
    assert [c.name for c in COMMANDS] == ["exporter", "capture-stacks", "set-interval"]


def test_once_print_on_fixture_root(root: Path, tmp_path: Path) -> None:
    args = [
        "--node",
        "n1",
        "--job",
        "j1",
        "--root",
        str(root),
        "--kernel-log",
        str(root / "var/log/kern.log"),
        "--socket",
        str(tmp_path / "r.sock"),
        "--cmd-pattern",
        "train.py",
        "--simulate-gpus",
        "8",
        "--state-dir",
        str(tmp_path / "never-written"),
        "--once",
        "--print",
    ]
    # The product's exporter with the demo's simulated GPUs (the demo's node agent).
    res = CliRunner().invoke(demo_exporter, args, obj={})
    assert res.exit_code == 0, res.output
    events = [json.loads(line) for line in res.output.splitlines()]
    kinds = [e["schema"] for e in events]
    assert kinds.count("gpu_batch") == 1 and kinds.count("host") == 1 and kinds.count("nic_batch") == 1
    assert kinds.count("log_line") == 18 and kinds.count("process_exit") == 1  # the fixture's zombie
    assert kinds[-1] == "heartbeat" and all(e["node"] == "n1" for e in events)
    gpu = next(e for e in events if e["schema"] == "gpu_batch")
    assert len(gpu["gpus"]) == 8 and gpu["job"] == "j1"
    # what the node's exporter watches, and what it skipped with why, is on the printed heartbeat
    hb = events[-1]
    assert hb["nics_watched"] == ["eth0", "eth1", "mlx5_0/1", "mlx5_1/1"] and hb["nics_watched_total"] == 4
    assert hb["nics_skipped"] == [{"name": "lo", "reason": "virtual: loopback"}]
    assert not (tmp_path / "never-written").exists()  # --once writes no state


def test_disable_and_interval_flags(root: Path, tmp_path: Path) -> None:
    base = ["--root", str(root), "--socket", str(tmp_path / "s.sock"), "--once", "--print"]
    res = CliRunner().invoke(
        exporter,
        [
            *base,
            "--disable",
            "nvml",
            "--disable",
            "kernel_log",
            "--disable",
            "process",
            "--interval",
            "nic=5",
        ],
        obj={},
    )
    assert res.exit_code == 0, res.output
    kinds = sorted({json.loads(line)["schema"] for line in res.output.splitlines()})
    assert kinds == ["heartbeat", "host", "nic_batch"]


def test_bad_usage_is_reported(root: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(exporter, ["--print"], obj={}).exit_code == 2
    bad_interval = runner.invoke(exporter, ["--interval", "nic", "--once", "--print"], obj={})
    assert bad_interval.exit_code == 2 and "SOURCE=SECONDS" in bad_interval.output
    unknown = runner.invoke(exporter, ["--disable", "gpus", "--once", "--print"], obj={})
    assert unknown.exit_code != 0 and "unknown field" in unknown.output
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("nic:\n  interval_s: 30\n  intreval: 3\n")
    typo = runner.invoke(exporter, ["--exporter-config", str(cfg), "--once", "--print"], obj={})
    assert typo.exit_code != 0 and "intreval" in typo.output
