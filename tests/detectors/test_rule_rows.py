"""One test per rule row: every row has examples, each example matches its own row, thresholds
escalate as the row says, and benign lines match nothing."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from trainguard.detectors.log_classifier import LogClassifier, classify_exit
from trainguard.detectors.rule_table import (
    Rule,
    RuleTable,
    RuleTableError,
    default_rule_table,
    load_rule_table,
    match_nic_state,
    match_nvml,
    parse_xid,
    required_literals,
)
from trainguard.schemas.enums import Action, Severity

TABLE = default_rule_table()
ROWS = list(TABLE.rules)
EXAMPLES = [(r.id, i, ex) for r in ROWS for i, ex in enumerate(r.examples)]
LOG_EXAMPLES = [(rid, i, ex) for rid, i, ex in EXAMPLES if TABLE.get(rid).source == "log"]
THRESHOLDED = [r for r in ROWS if r.thresholded]
ALL_XID_CODES = [(r.id, code) for r in ROWS for code in r.xid if not r.patterns]


def _where(rule: Rule) -> dict[str, bool]:
    """The match_line flags under which a row of ``rule.context`` applies."""
    return {
        "in_traceback": rule.context in ("traceback", "import"),
        "in_import": rule.context == "import",
        "in_kernel_trace": rule.context == "kernel_trace",
    }


def _matched_rule(rule: Rule, example: object) -> str | None:
    """The row id the classifier picks for ``example`` (the row under test, if it appears)."""
    if rule.source == "log":
        assert isinstance(example, str)
        m = TABLE.match_line(example, **_where(rule))
        return m.rule.id if m else None
    assert isinstance(example, dict)
    if rule.source == "nvml":
        ids = [m.rule.id for m in match_nvml(example)]
    elif rule.source == "nic":
        ids = [m.rule.id for m in match_nic_state(example)]
    else:
        return classify_exit(example.get("exit_code"), example.get("signal")).rule
    return rule.id if rule.id in ids else (ids[0] if ids else None)


def test_table_loads_with_every_source() -> None:
    assert {r.source for r in ROWS} == {"log", "nvml", "nic", "exit"}
    assert len(ROWS) > 80


@pytest.mark.parametrize("rule", ROWS, ids=lambda r: r.id)
def test_every_row_has_an_example(rule: Rule) -> None:
    assert rule.examples, f"rule {rule.id} has no example"
    assert rule.description, f"rule {rule.id} has no description"


@pytest.mark.parametrize(("rule_id", "idx", "example"), EXAMPLES, ids=[f"{r}-{i}" for r, i, _ in EXAMPLES])
def test_example_matches_its_row(rule_id: str, idx: int, example: object) -> None:
    assert _matched_rule(TABLE.get(rule_id), example) == rule_id


@pytest.mark.parametrize(
    "wrap",
    [
        lambda s: f"2024-05-01T10:22:33.123456+08:00 gpu-node-7 {s}",
        lambda s: f"Jun  3 08:21:17 node-12 kernel: {s}",
        lambda s: f"[rank13]: {s}",
        lambda s: f"<4>[ 8812.004113] {s}",
        lambda s: s.upper(),
        lambda s: f"   {s}   ",
    ],
    ids=["iso-host", "syslog", "rank", "dmesg-level", "upper", "spaces"],
)
def test_log_examples_survive_prefixes_and_case(wrap: Callable[[str], str]) -> None:
    misses = []
    for rule_id, _, ex in LOG_EXAMPLES:
        rule = TABLE.get(rule_id)
        line = wrap(ex)
        m = TABLE.match_line(line, **_where(rule))
        if m is None or m.rule.id != rule_id:
            misses.append((rule_id, line, m.rule.id if m else None))
    assert not misses


@pytest.mark.parametrize(("rule_id", "code"), ALL_XID_CODES, ids=[f"{r}-{c}" for r, c in ALL_XID_CODES])
def test_every_listed_xid_code_reaches_its_row(rule_id: str, code: int) -> None:
    line = f"[ 77.000001] NVRM: Xid (PCI:0000:3b:00): {code}, pid=4242, name=python, synthetic message"
    m = TABLE.match_line(line)
    assert (
        m is not None and m.rule.id == rule_id and m.fields["xid"] == code and m.fields["pci"] == "0000:3b:00"
    )


@pytest.mark.parametrize("rule", THRESHOLDED, ids=lambda r: r.id)
def test_threshold_rows_escalate(rule: Rule) -> None:
    """Below the count: below_action; at the count within the window: action."""
    clf = LogClassifier()
    step = max(rule.dedup_s * 2, 1.0)
    assert rule.window_s is not None and step * rule.count < rule.window_s
    results = []
    for i in range(rule.count):
        ex = rule.examples[0]
        if rule.source == "log":
            results.append(clf.classify(ex, ts=i * step))
        elif rule.source == "nvml":
            results.extend(c for c in clf.classify_nvml(ex, ts=i * step) if c.rule == rule.id)
        else:
            results.extend(c for c in clf.classify_nic(ex, ts=i * step) if c.rule == rule.id)
    assert [r.rule for r in results] == [rule.id] * rule.count
    assert results[0].action == (rule.below_action or Action.IGNORE) and not results[0].escalated
    assert results[-1].action == rule.action and results[-1].escalated
    assert results[-1].severity == rule.severity


@pytest.mark.parametrize("rule", THRESHOLDED, ids=lambda r: r.id)
def test_threshold_rows_forget_outside_the_window(rule: Rule) -> None:
    clf = LogClassifier()
    assert rule.window_s is not None
    for i in range(rule.count):
        ex = rule.examples[0]
        ts = i * (rule.window_s + rule.dedup_s + 1.0)
        if rule.source == "log":
            got = [clf.classify(ex, ts=ts)]
        elif rule.source == "nvml":
            got = [c for c in clf.classify_nvml(ex, ts=ts) if c.rule == rule.id]
        else:
            got = [c for c in clf.classify_nic(ex, ts=ts) if c.rule == rule.id]
        assert [c.escalated for c in got] == [False]


BENIGN = [
    "iteration      100/  500000 | consumed samples: 102400 | lm loss: 2.345E+00 | grad norm: 1.234 |",
    "[rank0]: saving checkpoint at iteration 1000 to /ckpt/iter_0001000",
    "node-1:1200:1300 [0] NCCL INFO Channel 00/32 :    0   1   2   3   4   5   6   7",
    "NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB eth0:10.0.0.1<0>",
    "kernel: EXT4-fs (nvme0n1p1): mounted filesystem with ordered data mode. Opts: (null)",
    "ECC errors: 0 volatile, 0 aggregate",
    "Jun  3 08:21:17 node-12 systemd[1]: Started Session 42 of user root.",
    "[    0.000000] Linux version 5.15.0-91-generic (buildd@lcy02-amd64-045)",
    "INFO: loading dataset with 1000 KeyError-free shards",
    "value error rate: 0.01",
    "total errors: 0, warnings: 3",
    "nvidia-smi: GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)",
    "Xid monitoring enabled",
    "IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready",
    "[2024-05-01 12:00:00,123] torch.distributed.run: [WARNING] Setting OMP_NUM_THREADS environment variable",
    "Successfully loaded checkpoint from iteration 2000",
    "mlx5_core 0000:5e:00.0: firmware version: 28.39.1002",
    "NFS: Registering the id_resolver key type",
    "",
    "    ",
    "\x00\x01\x02 binary junk \ufffd\ufffd",
    "Traceback (most recent call last):",
]


@pytest.mark.parametrize("line", BENIGN)
def test_benign_lines_match_nothing(line: str) -> None:
    c = LogClassifier().classify(line)
    assert (c.action, c.rule, c.category, c.severity) == (Action.NONE, None, None, None)


def test_unknown_xid_is_still_classified() -> None:
    m = TABLE.match_line("NVRM: Xid (PCI:0000:3b:00): 231, pid=1, name=python, brand new code")
    assert m is not None
    assert (m.rule.id, m.rule.category, m.rule.action, m.fields["xid"]) == (
        "xid-unknown",
        "xid",
        Action.DIAGNOSE,
        231,
    )


def test_xid_154_depends_on_the_recovery_action() -> None:
    none_line = "NVRM: Xid (PCI:0000:01:00): 154, pid=1, name=x, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)"
    reset_line = "NVRM: Xid (PCI:0000:01:00): 154, pid=1, name=x, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"
    assert TABLE.match_line(none_line).rule.action == Action.IGNORE  # type: ignore[union-attr]
    assert TABLE.match_line(reset_line).rule.action == Action.EVICT  # type: ignore[union-attr]


def test_xid_parse_fields_and_formats() -> None:
    f = parse_xid("[ 1.0] NVRM: Xid (PCI:0000:3B:00): 79, pid=1234, name=python, GPU has fallen off the bus.")
    assert f is not None
    assert f == {"xid": 79, "pci": "0000:3b:00", "pid": 1234, "process": "python", "message": f["message"]}
    assert "fallen off" in f["message"]
    assert parse_xid("Detected XID 79 on GPU 3")["xid"] == 79  # type: ignore[index]
    assert parse_xid("NVRM: Xid (0000:03:00): 13, 0000 00000000 ...")["xid"] == 13  # type: ignore[index]
    assert parse_xid("no xid here") is None


def test_ecc_semantics_contained_vs_uncontained() -> None:
    assert TABLE.get("xid-94").below_action == Action.RESTART  # contained: only the app died
    assert TABLE.get("xid-95").action == Action.EVICT and TABLE.get("xid-95").count == 1
    assert TABLE.get("xid-48").action == Action.EVICT
    assert TABLE.get("xid-63").action == Action.IGNORE  # remap recorded, catalog IGNORE
    assert TABLE.get("xid-64").action == Action.EVICT  # remap failed
    assert TABLE.get("xid-45").action == Action.IGNORE  # consequence of another error


def test_network_rows_tolerate_one_alert_in_five_minutes() -> None:
    for rid in ("nic-link-down", "nic-state-down"):
        r = TABLE.get(rid)
        assert (r.count, r.window_s, r.action, r.below_action) == (2, 300, Action.EVICT, Action.IGNORE)


def test_nvml_garbage_and_healthy_samples_match_nothing() -> None:
    assert match_nvml({"state": "ok", "temperature_c": 55.0, "throttle_reasons": ["sw_power_cap"]}) == []
    assert (
        match_nvml({"state": 3, "temperature_c": "hot", "throttle_reasons": 7, "remap_failure": "yes"}) == []
    )
    assert match_nvml("not a dict") == []  # type: ignore[arg-type]
    assert match_nvml({"temperature_c": float("nan"), "pcie_replay_count": 5}) == []
    assert match_nic_state({"interface": "ib0", "operstate": "up", "carrier": 1}) == []
    assert match_nic_state(None) == []  # type: ignore[arg-type]


def test_nvml_reports_every_matching_row() -> None:
    ids = [m.rule.id for m in match_nvml({"state": "lost", "remap_failure": True, "temperature_c": 95.0})]
    assert ids == ["nvml-gpu-lost", "nvml-remap-failure", "nvml-temperature-high"]


@pytest.mark.parametrize(
    ("exit_code", "signal", "rule", "action"),
    [
        (137, None, "exit-sigkill", Action.DIAGNOSE),
        (-9, None, "exit-sigkill", Action.DIAGNOSE),
        (None, "SIGKILL", "exit-sigkill", Action.DIAGNOSE),
        (None, "kill", "exit-sigkill", Action.DIAGNOSE),
        (139, None, "exit-sigsegv", Action.DIAGNOSE),
        (134, None, "exit-sigabrt", Action.DIAGNOSE),
        (1, None, "exit-nonzero", Action.DIAGNOSE),
        ("1", None, "exit-nonzero", Action.DIAGNOSE),
        (0, None, "exit-ok", Action.IGNORE),
        (143, None, "exit-terminated", Action.IGNORE),
        (127, None, "exit-launch-error", Action.ROLLBACK),
        ("garbage", None, None, Action.NONE),
        (None, "SIGNOTREAL", None, Action.NONE),
        (True, None, None, Action.NONE),
    ],
)
def test_classify_exit(exit_code: object, signal: object, rule: str | None, action: Action) -> None:
    c = classify_exit(exit_code, signal)
    assert (c.rule, c.action) == (rule, action)


# --- loading and validation -----------------------------------------------------------------


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "rules.yaml"
    p.write_text(text, encoding="utf-8")
    return p


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "rules:\n  - {id: a, category: c, severity: error, action: evict, patterns: [x], colour: red}",
            "unknown field",
        ),
        ("rules:\n  - {id: a, category: c, severity: error, action: none, patterns: [x]}", "not allowed"),
        ("rules:\n  - {id: a, category: c, severity: loud, action: evict, patterns: [x]}", "not one of"),
        (
            "rules:\n  - {id: a, category: c, severity: error, action: evict, patterns: ['(']}",
            "does not compile",
        ),
        (
            "rules:\n  - {id: a, category: c, severity: error, action: evict, patterns: [x], count: 2}",
            "window_s",
        ),
        ("rules:\n  - {id: a, category: c, severity: error, action: evict}", "needs patterns"),
        (
            "rules:\n  - {id: a, category: c, severity: error, action: evict, source: nvml, when: {t: {approx: 1}}}",
            "operator",
        ),
        (
            "rules:\n  - {id: a, category: c, severity: error, action: evict, patterns: [x]}\n"
            "  - {id: a, category: c, severity: error, action: evict, patterns: [y]}",
            "duplicate",
        ),
        ("rules: {a: 1}", "must be a list"),
        ("just a string", "top level"),
        ("rules: [\n", "not valid YAML"),
    ],
)
def test_bad_rule_files_are_clear_errors(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(RuleTableError, match=message):
        load_rule_table(_write(tmp_path, body))


def test_alternate_table_and_priorities(tmp_path: Path) -> None:
    table = load_rule_table(
        _write(
            tmp_path,
            "rules:\n"
            "  - {id: generic, priority: 200, category: c, severity: warning, action: diagnose, patterns: ['boom']}\n"
            "  - {id: specific, priority: 10, category: c, severity: error, action: evict, patterns: ['big boom']}\n",
        )
    )
    assert isinstance(table, RuleTable) and len(table) == 2
    assert table.match_line("a big boom here").rule.id == "specific"  # type: ignore[union-attr]
    assert table.match_line("a boom").rule.id == "generic"  # type: ignore[union-attr]
    assert table.match_line("NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, gone") is None


def test_rule_decide_without_threshold() -> None:
    r = Rule(id="x", category="c", severity=Severity.ERROR, action=Action.RESTART, patterns=["x"])
    assert r.decide(1) == (Action.RESTART, Severity.ERROR, False)


def test_literal_prefilter_never_changes_a_result() -> None:
    """The substring prefilter is an optimisation only: same answers as plain regex search."""
    plain = RuleTable(list(TABLE.rules), prefilter=False)
    rng = random.Random(11)
    lines = [ex for _, _, ex in LOG_EXAMPLES] + BENIGN
    lines += [ex.upper() for _, _, ex in LOG_EXAMPLES] + [
        f"[rank2]: {ex} \u00e9" for _, _, ex in LOG_EXAMPLES
    ]
    for _ in range(300):  # spliced fragments of real rows
        a, b = rng.choice(lines), rng.choice(lines)
        lines.append(a[: rng.randrange(len(a) + 1)] + b[rng.randrange(len(b) + 1) :])
    flags = [
        {"in_traceback": tb, "in_import": imp} for tb, imp in ((False, False), (True, False), (True, True))
    ]
    flags.append({"in_kernel_trace": True})
    for line in lines:
        for f in flags:
            fast, slow = TABLE.match_line(line, **f), plain.match_line(line, **f)
            assert (fast and (fast.rule.id, fast.fields)) == (slow and (slow.rule.id, slow.fields)), line


def test_required_literals_of_branches_and_groups() -> None:
    assert required_literals(r"abc(?:def|ghij)?x") == [frozenset({"abc"})]
    assert required_literals(r"(?:foo|ba)r") == []  # "ba" is too short to be a literal clause
    assert required_literals(r"(?:fooo|barr)\d+") == [frozenset({"fooo", "barr"})]
    assert required_literals("(") == []


NODE_ROWS = {
    r.id for r in ROWS if r.source == "log" and (r.origin == "node" or r.xid or r.xid_chain or r.xid_fallback)
}
NODE_EXAMPLES = [(rid, i, ex) for rid, i, ex in LOG_EXAMPLES if rid in NODE_ROWS]


def test_the_kernel_and_driver_rows_are_node_rows() -> None:
    """The rows that evict a machine for its kernel, driver or NIC are the node's own."""
    for rid in ("kernel-panic", "hung-task", "oom-killer", "nic-link-down", "sxid-fatal", "nvrm-gpu-lost"):
        assert rid in NODE_ROWS, rid
    for rid in ("python-exception", "cuda-illegal-access", "gpu-oom", "watchdog-timeout", "stale-handle"):
        assert rid not in NODE_ROWS, rid


@pytest.mark.parametrize(
    ("rid", "i", "example"), NODE_EXAMPLES, ids=[f"{r}-{i}" for r, i, _ in NODE_EXAMPLES]
)
def test_a_node_row_fires_on_the_nodes_line_not_on_a_process_printing_it(
    rid: str, i: int, example: str
) -> None:
    """Each node row's cited line matches it when the exporter read it from the node (or the
    origin is unknown, as for ``classify-log``), and never when a training process wrote it: a
    rank printing (or forging) a kernel line is that process's output (#38)."""
    rule = TABLE.get(rid)
    for from_node in (True, None):
        m = TABLE.match_line(example, **_where(rule), from_node=from_node)
        assert m is not None and m.rule.id == rid, (from_node, m and m.rule.id)
    m = TABLE.match_line(example, **_where(rule), from_node=False)
    assert m is None or m.rule.id not in NODE_ROWS, m.rule.id


def test_an_origin_is_checked() -> None:
    with pytest.raises(ValueError, match="origin 'rank'"):
        Rule(
            id="x", category="c", severity=Severity.INFO, action=Action.IGNORE, patterns=["x"], origin="rank"
        )
    with pytest.raises(ValueError, match="origin applies to log rows"):
        Rule(id="x", category="c", severity=Severity.INFO, action=Action.IGNORE, source="nvml",
             when={"xid": {"gt": 0}}, origin="node")  # fmt: skip
