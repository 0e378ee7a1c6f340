"""LogClassifier: tracebacks per rank, thresholds on explicit/line timestamps, exit codes, the
window counter and the classify-log CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.commands.classify import COMMANDS, classify_log
from trainguard.detectors.log_classifier import (
    Classification,
    ClassifierConfig,
    LogClassifier,
    classify_exit,
    parse_timestamp,
    split_prefix,
)
from trainguard.detectors.windows import WindowCounter, WindowTracker
from trainguard.schemas.config import ConfigError, load_config
from trainguard.schemas.enums import Action, Severity

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "logs"

TB_USER = """Traceback (most recent call last):
  File "/workspace/llm/pretrain.py", line 412, in <module>
    main()
  File "/workspace/llm/model/moe.py", line 77, in route
    idx = experts[token_ids]
          ~~~~~~~^^^^^^^^^^^
  File "/usr/local/lib/python3.11/site-packages/torch/_tensor.py", line 40, in wrapped
    return f(*args, **kwargs)
  File "/usr/lib/python3.11/functools.py", line 909, in wrapper
    return dispatch(args[0].__class__)(*args, **kw)
IndexError: index 64 is out of bounds for dimension 0 with size 64"""


def feed_all(text: str, clf: LogClassifier | None = None) -> list[Classification]:
    clf = clf or LogClassifier()
    return [clf.feed(line) for line in text.splitlines()]


def test_traceback_blames_the_last_user_frame() -> None:
    out = feed_all(TB_USER)
    assert [c.action for c in out[:-1]] == [Action.NONE] * (len(out) - 1)
    last = out[-1]
    assert (last.action, last.rule, last.category) == (Action.ROLLBACK, "user-exception", "user_code")
    assert last.fields["exception"] == "IndexError"
    assert last.fields["user_module"] == "/workspace/llm/model/moe.py"
    assert (last.fields["user_line"], last.fields["user_function"]) == (77, "route")


def test_interleaved_ranks_keep_separate_tracebacks() -> None:
    a = [f"[rank1]: {line}" for line in TB_USER.splitlines()]
    b = [
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/workspace/llm/train_step.py", line 10, in step',
        "[rank0]:     loss.backward()",
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
    ]
    lines = [x for pair in zip(a, b + [""] * (len(a) - len(b)), strict=True) for x in pair if x]
    clf = LogClassifier()
    out = {c.line: c for c in (clf.feed(line) for line in lines)}
    oom = out[b[-1]]
    assert (oom.rule, oom.fields["rank"], oom.fields["user_module"]) == (
        "gpu-oom",
        0,
        "/workspace/llm/train_step.py",
    )
    user = out[a[-1]]
    assert (user.rule, user.fields["rank"], user.fields["user_module"]) == (
        "user-exception",
        1,
        "/workspace/llm/model/moe.py",
    )


def test_other_rank_prefix_styles() -> None:
    for prefix in ("[default3]:", "[1,3]<stderr>:", "3: ", "2024-05-01T10:00:00Z node-2 [rank3]: "):
        out = feed_all("\n".join(prefix + line for line in TB_USER.splitlines()))
        assert out[-1].fields.get("rank") == 3 and out[-1].fields["user_module"].endswith("moe.py"), prefix


def test_traceback_without_user_frame() -> None:
    tb = """Traceback (most recent call last):
  File "/opt/conda/lib/python3.10/site-packages/megatron_lib/x.py", line 3, in f
    g()
  File "<frozen importlib._bootstrap>", line 1, in _find
KeyError: 'layers.0.weight'"""
    default = feed_all(tb)[-1]
    assert default.action == Action.ROLLBACK and "user_module" not in default.fields
    strict = feed_all(tb, LogClassifier(config=ClassifierConfig(require_user_frame=True)))[-1]
    assert (strict.action, strict.rule, strict.fields["culprit"]) == (Action.DIAGNOSE, "user-exception", None)


def test_traceback_ending_in_cuda_error_keeps_the_specific_rule() -> None:
    tb = 'Traceback (most recent call last):\n  File "/w/t.py", line 1, in f\nRuntimeError: CUDA error: an illegal memory access was encountered'
    last = feed_all(tb)[-1]
    assert (last.rule, last.action, last.fields["exception"]) == (
        "cuda-illegal-access",
        Action.DIAGNOSE,
        "RuntimeError",
    )


def test_unexplained_traceback_is_a_crash_without_culprit() -> None:
    tb = 'Traceback (most recent call last):\n  File "/w/t.py", line 1, in f\nmylib.errors.ShardingMismatch: rank 3 got 7 shards'
    last = feed_all(tb)[-1]
    assert (last.rule, last.action, last.category) == ("python-exception", Action.DIAGNOSE, "crash")
    # the same line outside a traceback is not an exception report
    assert (
        LogClassifier().classify("mylib.errors.ShardingMismatch: rank 3 got 7 shards").action == Action.NONE
    )


def test_chained_tracebacks_and_bare_exception() -> None:
    tb = (
        TB_USER
        + "\n\nDuring handling of the above exception, another exception occurred:\n\n"
        + TB_USER.replace(
            "IndexError: index 64 is out of bounds for dimension 0 with size 64", "AssertionError"
        )
    )
    out = feed_all(tb)
    finals = [c for c in out if c.matched]
    assert [c.fields["exception"] for c in finals] == ["IndexError", "AssertionError"]
    assert all(c.action == Action.ROLLBACK for c in finals)


def test_cut_off_traceback_falls_back_to_line_rules() -> None:
    lines = [
        "Traceback (most recent call last):",
        '  File "/w/t.py", line 1, in f',
        "    x()",
        "[ 88.1] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus.",
    ]
    assert feed_all("\n".join(lines))[-1].rule == "xid-79"


def test_code_lines_without_indentation_are_not_exceptions() -> None:
    tb = 'Traceback (most recent call last):\nFile "/w/t.py", line 1, in f\nValueError: x\n'
    assert feed_all(tb)[-1].rule == "user-exception"
    tb2 = 'Traceback (most recent call last):\nFile "/w/t.py", line 1, in f\nelse:\nKeyError: 1'
    assert [c.rule for c in feed_all(tb2)] == [None, None, None, "user-exception"]


def test_many_open_tracebacks_are_bounded() -> None:
    clf = LogClassifier(config=ClassifierConfig(max_streams=8, max_frames=4))
    for r in range(100):
        clf.feed(f"[rank{r}]: Traceback (most recent call last):")
        for _ in range(10):
            clf.feed(f'[rank{r}]:   File "/w/t.py", line 1, in f')
    assert len(clf._open) == 8
    assert all(len(tb.frames) == 4 for tb in clf._open.values())
    assert clf.feed("[rank99]: KeyError: 1").fields["frames"] == 4
    clf.flush()
    assert not clf._open


def test_stateless_classify_of_bare_exception_line() -> None:
    c = LogClassifier().classify(
        "[rank3]: TypeError: unsupported operand type(s) for +: 'NoneType' and 'int'"
    )
    assert (c.action, c.rule, c.fields["exception"], c.fields["rank"]) == (
        Action.ROLLBACK,
        "user-exception",
        "TypeError",
        3,
    )


def test_nic_flapping_needs_two_alerts_in_five_minutes_per_interface() -> None:
    clf = LogClassifier()
    ib0 = "mlx5_core 0000:5e:00.0 ib0: Link down"
    ib1 = "mlx5_core 0000:5f:00.0 ib1: Link down"
    assert clf.classify(ib0, ts=0.0).action == Action.IGNORE
    assert clf.classify(ib1, ts=10.0).action == Action.IGNORE  # other interface: own counter
    hit = clf.classify(ib0, ts=299.0)
    assert (hit.action, hit.count, hit.escalated, hit.fields["interface"]) == (Action.EVICT, 2, True, "ib0")
    assert clf.classify(ib1, ts=400.0).action == Action.IGNORE  # 390 s after its first alert
    assert clf.classify(ib0, ts=299.0, host="other-node").action == Action.IGNORE  # hosts count apart


def test_thresholds_use_line_timestamps_when_no_ts_given() -> None:
    clf = LogClassifier()
    first = clf.classify("[  100.000000] mlx5_core 0000:5e:00.0 ib0: Link down")
    far = clf.classify("[  900.000000] mlx5_core 0000:5e:00.0 ib0: Link down")
    near = clf.classify("[  950.000000] mlx5_core 0000:5e:00.0 ib0: Link down")
    assert (first.action, far.action, near.action) == (Action.IGNORE, Action.IGNORE, Action.EVICT)
    assert near.ts == 950.0


def test_xid13_bursts_are_deduplicated() -> None:
    clf = LogClassifier()
    burst = [
        f"[ 1234.56789{i}] NVRM: Xid (PCI:0000:b1:00): 13, pid=1, name=python, Graphics SM Warp Exception on (GPC 0, TPC 1, SM {i})"
        for i in range(8)
    ]
    assert {clf.feed(line).action for line in burst} == {Action.RESTART}
    other_gpu = clf.feed("[ 1300.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=python, Graphics Exception")
    assert other_gpu.count == 1
    later = [
        clf.feed(f"[ {t}.0] NVRM: Xid (PCI:0000:b1:00): 13, pid=1, name=python, Graphics Exception")
        for t in (1800, 2400)
    ]
    assert [c.action for c in later] == [Action.RESTART, Action.EVICT]


def test_nvml_thresholds_and_findings() -> None:
    clf = LogClassifier()
    hot = {"gpu": 3, "state": "ok", "temperature_c": 92.0}
    got = [clf.classify_nvml(hot, ts=t)[0] for t in (0.0, 10.0, 20.0)]
    assert [c.action for c in got] == [Action.IGNORE, Action.IGNORE, Action.DIAGNOSE]
    assert clf.classify_nvml({"gpu": 4, "state": "ok", "temperature_c": 92.0}, ts=25.0)[0].count == 1
    lost = clf.classify_nvml({"gpu": 3, "state": "lost"}, ts=30.0)[0]
    f = lost.to_finding(job="j", node="n1")
    assert f is not None and (f.kind, f.category, f.action, f.node) == (
        "nvml_rule",
        "gpu_unavailable",
        Action.EVICT,
        "n1",
    )
    nic = clf.classify_nic({"interface": "ib0", "operstate": "down"}, ts=1.0)
    assert [c.rule for c in nic] == ["nic-state-down"]


def test_classification_json_and_finding() -> None:
    c = LogClassifier().classify("[rank2]: RuntimeError: CUDA error: uncorrectable ECC error encountered")
    assert c.to_json() == {
        "line": c.line,
        "category": "gpu_memory_error",
        "severity": "critical",
        "action": "evict",
        "rule": "cuda-ecc",
    }
    f = c.to_finding(job="job-1")
    assert (
        f is not None
        and f.ranks == (2,)
        and f.severity == Severity.CRITICAL
        and f.evidence["rule"] == "cuda-ecc"
    )
    none = LogClassifier().classify("all good")
    assert none.to_json() == {
        "line": "all good",
        "category": None,
        "severity": None,
        "action": "none",
        "rule": None,
    }
    assert none.to_finding() is None


@pytest.mark.parametrize(
    "junk", [None, 42, b"bytes", "\x00" * 10, "x" * 200_000, "Xid (" * 1000, "[rank" * 500]
)
def test_garbage_never_crashes(junk: object) -> None:
    clf = LogClassifier()
    for fn in (clf.classify, clf.feed):
        c = fn(junk)  # type: ignore[arg-type]
        assert isinstance(c, Classification)


def test_random_bytes_never_crash() -> None:
    rng = random.Random(7)
    clf = LogClassifier()
    for _ in range(300):
        line = bytes(rng.randrange(256) for _ in range(rng.randrange(120))).decode("utf-8", "replace")
        assert isinstance(clf.feed(line), Classification)


def test_classify_exit_prefers_a_traceback_culprit() -> None:
    r = classify_exit(1, None, TB_USER)
    assert (r.action, r.rule, r.fields["user_module"], r.fields["exit_code"]) == (
        Action.ROLLBACK,
        "user-exception",
        "/workspace/llm/model/moe.py",
        1,
    )
    tail = (
        "some log\n[ 1.0] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus.\n"
    )
    # The tail is the process's own output: an Xid line in it speaks for the node's driver only
    # when the node exporter read it from the kernel, so the exit is judged by its signal.
    assert classify_exit(-6, None, tail).rule == "exit-sigabrt"
    cuda = "some log\nRuntimeError: CUDA error: an illegal memory access was encountered\n"
    assert classify_exit(-6, None, cuda).rule == "cuda-illegal-access"
    assert classify_exit(137, None, "nothing useful here\n").rule == "exit-sigkill"
    assert classify_exit(1, None, "").rule == "exit-nonzero"


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("2024-05-01T00:00:05.5Z x", 1714521605.5),
        ("2024-05-01 08:00:05,250+08:00 x", 1714521605.25),
        ("[2024-05-01 00:00:05] x", 1714521605.0),
        ("[   12.250000] x", 12.25),
        ("Jan  1 00:00:10 host kernel: x", 978307210.0),
        ("2024-13-45T99:00:00 x", None),
        ("x 2024-05-01T00:00:05Z", None),
        ("", None),
    ],
)
def test_parse_timestamp(line: str, expected: float | None) -> None:
    assert parse_timestamp(line) == expected


def test_split_prefix() -> None:
    assert split_prefix("[rank7]:   File x") == ("  File x", 7)
    assert split_prefix("[  1.0] mlx5_core x") == ("mlx5_core x", None)
    assert split_prefix("no prefix") == ("no prefix", None)


def test_config_loads_and_rejects_unknown_keys() -> None:
    cfg = load_config(
        ClassifierConfig,
        {"require_user_frame": True},
        env_prefix="TG_CLF",
        environ={"TG_CLF__MAX_FRAMES": "9"},
    )
    assert cfg.require_user_frame and cfg.max_frames == 9
    with pytest.raises(ConfigError, match="unknown"):
        load_config(ClassifierConfig, {"max_frame": 1})


# --- windows ----------------------------------------------------------------------------------


def test_window_counter_out_of_order_and_validation() -> None:
    w = WindowCounter(window_s=10)
    assert [w.observe(t) for t in (5.0, 1.0, 9.0)] == [1, 1, 3]
    assert w.count(20.0) == 0
    with pytest.raises(ValueError):
        WindowCounter(window_s=0)
    with pytest.raises(ValueError):
        w.observe(float("nan"))
    tr = WindowTracker(max_keys=2)
    for k in "abc":
        tr.observe(k, 0.0, 10)
    assert len(tr) == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=1000, allow_nan=False), min_size=1, max_size=40))
def test_window_counter_matches_brute_force(times: list[float]) -> None:
    times = sorted(times)  # in-order stream: every event is kept, so a brute-force count is exact
    w = WindowCounter(window_s=100)
    for i, t in enumerate(times):
        assert w.observe(t) == sum(1 for s in times[: i + 1] if t - 100 <= s <= t)


# --- CLI ---------------------------------------------------------------------------------------


def test_cli_json_one_object_per_line() -> None:
    path = FIXTURES / "mixed_training.log"
    res = CliRunner().invoke(classify_log, [str(path), "--json"])
    assert res.exit_code == 0, res.output
    objs = [json.loads(x) for x in res.output.splitlines()]
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [o["line"] for o in objs] == lines
    assert all(set(o) == {"line", "category", "severity", "action", "rule"} for o in objs)
    assert {o["action"] for o in objs} <= {"evict", "restart", "rollback", "diagnose", "ignore", "none"}
    by_rule = {o["rule"]: o for o in objs if o["rule"]}
    assert by_rule["user-exception"]["line"].endswith(
        "IndexError: index 64 is out of bounds for dimension 0 with size 64"
    )
    assert by_rule["xid-79"]["action"] == "evict"
    link = [o["action"] for o in objs if o["rule"] == "nic-link-down"]
    assert link == ["ignore", "evict"]
    assert all(o["category"] is None and o["severity"] is None for o in objs if o["action"] == "none")


def test_cli_dmesg_fixture_escalates_xid13() -> None:
    res = CliRunner().invoke(classify_log, [str(FIXTURES / "dmesg_xid.log"), "--json"])
    objs = [json.loads(x) for x in res.output.splitlines()]
    xid13 = [o["action"] for o in objs if o["rule"] == "xid-13"]
    assert xid13 == ["restart", "restart", "restart", "evict"]
    assert [o["rule"] for o in objs][-4:] == ["xid-94", "xid-95", "xid-unknown", "oom-killer"]


def test_cli_stdin_text_mode_and_garbage_bytes() -> None:
    data = b"hello\n\xff\xfe\x00 garbage\nkernel: Kernel panic - not syncing: Fatal exception\n"
    res = CliRunner().invoke(classify_log, ["-"], input=data)
    assert res.exit_code == 0
    assert "kernel-panic" in res.output and "evict" in res.output and "hello" in res.output
    only = CliRunner().invoke(classify_log, ["-", "--matched-only"], input=data)
    assert "hello" not in only.output and "kernel-panic" in only.output


def test_cli_alternate_rules(tmp_path: Path) -> None:
    rules = tmp_path / "r.yaml"
    rules.write_text(
        "rules:\n  - {id: hello-rule, category: demo, severity: info, action: ignore, patterns: ['^hello$'],"
        " examples: [hello]}\n",
        encoding="utf-8",
    )
    res = CliRunner().invoke(
        classify_log, ["-", "--json", "--rules", str(rules)], input="hello\nKernel panic - not syncing\n"
    )
    objs = [json.loads(x) for x in res.output.splitlines()]
    assert [o["rule"] for o in objs] == ["hello-rule", None]
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - {id: x}\n", encoding="utf-8")
    res = CliRunner().invoke(classify_log, ["-", "--rules", str(bad)], input="x\n")
    assert res.exit_code != 0 and "bad.yaml" in res.output


def test_commands_exported() -> None:
    assert [c.name for c in COMMANDS] == ["classify-log"]
