"""``trainguard preflight``: the verdict of a diag run, the record of a check (log directory,
pending resend, Kafka away), the Kubernetes cordon patch, and the command's registration."""

from __future__ import annotations

import json
import tomllib
from importlib import import_module
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from tests.net import free_port
from trainguard.commands.preflight import ANNOTATION_REASON, LABEL, cordon_node, preflight
from trainguard.diag.preflight import MAX_REASON_CHARS, PreflightPolicy, judge, read_results
from trainguard.schemas.codec import decode
from trainguard.schemas.config import ConfigError
from trainguard.schemas.telemetry import CheckAction, CheckOutcome, NodeCheck

ROOT = Path(__file__).resolve().parents[2]

PASS: dict[str, Any] = {
    "test": "gpu-health",
    "passed": None,
    "skipped_reason": "no GPU",
    "findings": [],
    "duration_s": 0.1,
}
DIGEST_OK: dict[str, Any] = {"test": "gemm-digest", "passed": True, "findings": [], "duration_s": 2.5}
DIGEST_BAD: dict[str, Any] = {
    "test": "gemm-digest",
    "passed": False,
    "findings": ["cpu: digest 9f86d081884c7d65... differs from the expected 00000000000000..."],
    "duration_s": 2.5,
}


def _results(tmp_path: Path, *lines: dict[str, Any] | str) -> Path:
    path = tmp_path / "results.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _run(args: list[str], env: dict[str, str] | None = None, config: str | None = None) -> Result:
    return CliRunner().invoke(preflight, args, env=env or {}, obj={"config_path": config, "quiet": True})


# -- the verdict ------------------------------------------------------------------------------------


def test_a_failed_test_fails_the_node_whatever_the_exit_status() -> None:
    for code in (1, 0, 124, 137):
        v = judge([PASS, DIGEST_BAD], code, timeout_s=90)
        assert v.outcome is CheckOutcome.FAILED and v.failed_tests == ("gemm-digest",)
        assert v.reason == f"trainguard preflight: gemm-digest: {DIGEST_BAD['findings'][0]}"
        assert set(v.results) == {"gpu-health", "gemm-digest"} and v.duration_s == 2.6


def test_several_failures_name_the_first_and_count_the_rest() -> None:
    mem = {"test": "memory", "passed": False, "findings": ["cuda:0: 3 bad words", "cuda:1: 1 bad word"]}
    v = judge([DIGEST_BAD, mem], 1)
    assert v.failed_tests == ("gemm-digest", "memory") and v.reason.endswith("(+2 more)")


def test_a_hang_past_the_limit_fails_and_an_unexplained_exit_is_an_error() -> None:
    hung = judge([DIGEST_OK], 124, timeout_s=120)
    assert hung.outcome is CheckOutcome.FAILED and hung.failed_tests == ("timeout",)
    assert "did not finish in 120 s (results of gemm-digest only)" in hung.reason
    # 124 without a limit given is just an exit status diag does not use: an error
    assert judge([DIGEST_OK], 124).outcome is CheckOutcome.ERROR
    usage = judge([], 2, diag_error="Error: Invalid value for '--level': 'quik'")
    assert usage.outcome is CheckOutcome.ERROR
    assert (
        usage.reason
        == "trainguard preflight: error: diag exited 2: Error: Invalid value for '--level': 'quik'"
    )
    assert judge([DIGEST_OK], 1).reason.endswith("diag exited 1 without a failed result")
    assert judge([], 0).reason.endswith("diag ran no test")
    assert judge([PASS, DIGEST_OK], 0).outcome is CheckOutcome.PASSED


def test_the_reason_is_one_capped_line() -> None:
    bad = {"test": "dcgm", "passed": False, "findings": ["line one\nline\ttwo\x1b[31m " + "x" * 500]}
    reason = judge([bad], 1).reason
    assert "\n" not in reason and "\x1b" not in reason and len(reason) == MAX_REASON_CHARS
    assert reason.startswith("trainguard preflight: dcgm: line one line two [31m x") and reason.endswith(
        "..."
    )
    assert judge([{"test": "memory", "passed": False}], 1).reason.endswith("memory: failed without a finding")


def test_unreadable_results_are_an_error_naming_the_line(tmp_path: Path) -> None:
    lines, problems = read_results(_results(tmp_path, DIGEST_OK, "{not json", '["a list"]'))
    assert lines == [DIGEST_OK] and len(problems) == 2 and problems[0].endswith(":2: not JSON")
    v = judge(lines, 0, problems)
    assert v.outcome is CheckOutcome.ERROR and "not JSON (+1 more)" in v.reason
    assert read_results(tmp_path / "none.jsonl")[1][0].endswith("no results file (diag wrote nothing)")


def test_the_policy_decides_what_is_done() -> None:
    assert [PreflightPolicy().action(o) for o in CheckOutcome] == ["none", "drain", "none"]
    assert [PreflightPolicy("warn").action(o) for o in CheckOutcome] == ["none", "warn", "none"]
    assert [PreflightPolicy("warn", "drain").action(o) for o in CheckOutcome] == ["none", "warn", "warn"]
    with pytest.raises(ConfigError, match="on_error 'ignore': expected one of allow, drain"):
        PreflightPolicy(on_error="ignore")


def test_verdict_prints_action_outcome_and_reason(tmp_path: Path) -> None:
    res = _run(["verdict", str(_results(tmp_path, PASS, DIGEST_BAD)), "--diag-exit", "1"])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines() == [
        "drain",
        "failed",
        f"trainguard preflight: gemm-digest: {DIGEST_BAD['findings'][0]}",
    ]
    res = _run(["verdict", str(_results(tmp_path, PASS)), "--diag-exit", "0", "--policy", "warn"])
    assert res.output.splitlines() == ["none", "passed", ""]
    stderr = tmp_path / "diag.log"
    stderr.write_text("diag: gemm-digest ...\nModuleNotFoundError: No module named 'torch'\n\n")
    res = _run(["verdict", str(tmp_path / "missing.jsonl"), "--diag-exit", "3", "--diag-stderr", str(stderr)])
    assert res.output.splitlines() == [
        "none",
        "error",
        "trainguard preflight: error: diag exited 3: ModuleNotFoundError: No module named 'torch'",
    ]
    res = _run(["verdict", str(tmp_path / "r.jsonl"), "--diag-exit", "0", "--policy", "drian"])
    assert res.exit_code == 2 and "'drian' is not one of 'drain', 'warn'" in res.output


# -- the record -------------------------------------------------------------------------------------


def _record(tmp_path: Path, *extra: str, config: str | None = None, results: Path | None = None) -> Result:
    path = results or _results(tmp_path, PASS, DIGEST_BAD)
    args = ["record", str(path), "--diag-exit", "1", "--node", "n7", "--origin", "slurm-prolog"]
    return _run([*args, "--job", "4242", "--action-taken", "drained", *extra], config=config)


def test_record_keeps_the_check_in_the_nodes_log_dir(tmp_path: Path) -> None:
    res = _record(tmp_path, "--log-dir", str(tmp_path / "log"))
    assert res.exit_code == 0, res.output
    (path,) = (tmp_path / "log" / "n7").glob("*.pending.json")  # no config: not published, pending
    assert path.name.split("-")[1] == "4242" and "kept in" in res.output
    ev = decode(path.read_bytes(), NodeCheck)
    assert isinstance(ev, NodeCheck)
    assert (ev.node, ev.origin, ev.job, ev.outcome, ev.action, ev.policy) == (
        "n7",
        "slurm-prolog",
        "4242",
        CheckOutcome.FAILED,
        CheckAction.DRAINED,
        "drain",
    )
    assert ev.failed_tests == ["gemm-digest"] and ev.results["gemm-digest"]["passed"] is False
    assert ev.reason.startswith("trainguard preflight: gemm-digest: cpu: digest")


def test_kafka_away_leaves_the_records_pending_and_exits_0(tmp_path: Path) -> None:
    config = tmp_path / "tg.yaml"
    config.write_text(f"kafka:\n  bootstrap_servers: 127.0.0.1:{free_port()}\n")
    log = tmp_path / "log"
    for _ in range(2):
        res = _record(tmp_path, "--log-dir", str(log), "--publish-timeout-s", "1", config=str(config))
        assert res.exit_code == 0, res.output
        assert (
            "WARNING: not published (BusError: cannot reach Kafka" in res.output
            and "kept pending" in res.output
        )
    assert len(list((log / "n7").glob("*.pending.json"))) == 2
    # without a log dir, a record Kafka did not take is kept nowhere: exit 1
    res = _record(tmp_path, "--publish-timeout-s", "1", config=str(config))
    assert res.exit_code == 1 and "NOT kept anywhere" in res.output


def test_an_unwritable_log_dir_is_a_warning_not_a_crash(tmp_path: Path) -> None:
    blocker = tmp_path / "log"
    blocker.write_text("a file where the directory should be")
    res = _record(tmp_path, "--log-dir", str(blocker / "sub"))
    assert res.exit_code == 0 and "WARNING: cannot keep the record in" in res.output
    assert "not kept (no --log-dir, no Kafka)" in res.output


def test_damaged_pending_records_are_set_aside_not_resent_forever(tmp_path: Path) -> None:
    from trainguard.commands.preflight import _load

    bad = tmp_path / "20260101T000000.000000Z-1-abc.pending.json"
    bad.write_text("{oops")
    assert _load(bad) is None
    assert not bad.exists() and (tmp_path / "20260101T000000.000000Z-1-abc.bad.json").exists()


def test_a_bad_node_name_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    res = _run(
        [
            *("record", str(_results(tmp_path, DIGEST_OK)), "--diag-exit", "0", "--node", "../etc"),
            *("--action-taken", "none", "--log-dir", str(tmp_path / "log")),
        ]
    )
    assert res.exit_code == 2 and "cannot record this check" in res.output and "node" in res.output
    assert not (tmp_path / "log").exists()


def test_old_files_of_the_node_are_pruned(tmp_path: Path) -> None:
    import os

    node_dir = tmp_path / "log" / "n7"
    node_dir.mkdir(parents=True)
    old = node_dir / "20200101T000000Z-1-1.jsonl"
    old.write_text("{}\n")
    os.utime(old, (1_600_000_000, 1_600_000_000))
    assert _record(tmp_path, "--log-dir", str(tmp_path / "log")).exit_code == 0
    assert not old.exists() and len(list(node_dir.glob("*.pending.json"))) == 1


# -- Kubernetes cordon ------------------------------------------------------------------------------


class FakeCoreV1:
    def __init__(self) -> None:
        self.patches: list[tuple[str, dict[str, Any]]] = []

    def patch_node(self, name: str, body: dict[str, Any]) -> None:
        self.patches.append((name, body))


def test_cordon_patches_unschedulable_with_the_reason() -> None:
    api = FakeCoreV1()
    cordon_node(api, "gpu-17", "trainguard preflight: memory: cuda:3: 12 bad words", pod="llm-worker-3")
    ((name, body),) = api.patches
    assert name == "gpu-17" and body["spec"] == {"unschedulable": True}
    assert body["metadata"]["labels"] == {LABEL: "failed"}
    ann = body["metadata"]["annotations"]
    assert (
        ann[ANNOTATION_REASON].endswith("12 bad words")
        and ann["trainguard.io/preflight-pod"] == "llm-worker-3"
    )


def test_registered_as_a_trainguard_command() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    module, _, attr = pyproject["project"]["entry-points"]["trainguard.commands"]["preflight"].partition(":")
    assert getattr(import_module(module), attr) is preflight
