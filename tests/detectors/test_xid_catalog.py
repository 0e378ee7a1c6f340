"""The Xid catalog (detectors/rules/catalog/xid.yaml): complete, valid, consistent with the Xid
rows, its bucket -> action policy, and the rule table deciding by it (codes no row names, chains)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.detectors.log_classifier import LogClassifier
from trainguard.detectors.rule_table import RuleTable, default_rule_table
from trainguard.detectors.xid_catalog import (
    BUCKETS,
    CATALOG_PATH,
    XidCatalogError,
    default_xid_catalog,
    load_xid_catalog,
)
from trainguard.schemas.enums import Action, Severity

CATALOG = default_xid_catalog()
TABLE = default_rule_table()
XID_ROWS = [r for r in TABLE.rules if r.xid]
CODES = sorted({c for r in XID_ROWS for c in r.xid})


def test_catalog_has_no_gaps() -> None:
    assert sorted(CATALOG.entries) == list(range(1, max(CATALOG.entries) + 1))
    assert max(CATALOG.entries) >= 172


def test_every_code_the_rules_name_is_in_the_catalog() -> None:
    assert [c for c in CODES if c not in CATALOG] == []


def test_every_bucket_is_valid_and_has_a_policy() -> None:
    assert {e.bucket for e in CATALOG.entries.values()} <= set(BUCKETS)
    assert set(CATALOG.policy) == set(BUCKETS)
    for e in CATALOG.entries.values():
        assert e.name, e.code
        assert e.action is None or e.why, f"Xid {e.code} overrides its bucket without saying why"


def test_policy_for_a_training_job() -> None:
    """A GPU that needs a reset, a reboot or hands-on work cannot be used by the job: evict."""
    act = {b: CATALOG.policy[b][0] for b in BUCKETS}
    assert act == {
        "restart_app": Action.RESTART,
        "reset_gpu": Action.EVICT,
        "reboot_node": Action.EVICT,
        "contact_support": Action.EVICT,
        "ignore": Action.IGNORE,
    }
    assert CATALOG.policy["reset_gpu"][1] is Severity.CRITICAL


@pytest.mark.parametrize("code", CODES)
def test_rows_agree_with_the_catalog(code: int) -> None:
    """Each code's catalog decision is what one of its rows recommends (at once or below its
    threshold): the rows refine a bucket (thresholds, Fatal/Nonfatal, message), never contradict it."""
    decided = CATALOG.decide(code)
    assert decided is not None
    rows = [r for r in XID_ROWS if code in r.xid]
    assert any(decided[0] in (r.action, r.below_action) for r in rows), (code, decided, [r.id for r in rows])


@pytest.mark.parametrize(
    ("code", "bucket", "action"),
    [
        (79, "reboot_node", Action.EVICT),
        (48, "reset_gpu", Action.EVICT),
        (95, "reset_gpu", Action.EVICT),
        (119, "reset_gpu", Action.EVICT),
        (13, "restart_app", Action.RESTART),
        (94, "restart_app", Action.RESTART),
        (63, "ignore", Action.IGNORE),
        (45, "ignore", Action.IGNORE),
        (58, "contact_support", Action.EVICT),
        (61, "contact_support", Action.DIAGNOSE),  # unused on Ampere and newer
    ],
)
def test_known_codes(code: int, bucket: str, action: Action) -> None:
    assert CATALOG.entry(code).bucket == bucket
    assert CATALOG.decide(code)[0] is action  # type: ignore[index]


def test_a_code_no_row_names_is_decided_by_the_catalog() -> None:
    rows = [r for r in TABLE.rules if r.id != "xid-79"]
    table = RuleTable(rows)
    line = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus."
    c = LogClassifier(table).classify(line)
    assert (c.rule, c.action, c.severity, c.fields["catalog_bucket"]) == (
        "xid-unknown",
        Action.EVICT,
        Severity.CRITICAL,
        "reboot_node",
    )
    new = LogClassifier(table).classify("NVRM: Xid (PCI:0000:3b:00): 231, pid=1, name=python, new")
    assert (new.rule, new.action, new.category) == ("xid-unknown", Action.DIAGNOSE, "xid")


def test_chains_follow_the_cause_through_the_catalog() -> None:
    line = "NVRM: Xid (PCI:0000:3b:00): 45, pid=7, name=python, Ch 00000010 caused by previous Xid {}"
    got = {n: LogClassifier().classify(line.format(n)).action for n in (48, 79, 13, 63, 61)}
    assert got == {
        48: Action.EVICT,
        79: Action.EVICT,
        13: Action.RESTART,
        63: Action.IGNORE,
        61: Action.DIAGNOSE,
    }


def _catalog(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "xid.yaml"
    p.write_text(text, encoding="utf-8")
    return p


HEAD = (
    "buckets: [restart_app, reset_gpu, reboot_node, contact_support, ignore]\n"
    "policy:\n"
    "  restart_app: {action: restart, severity: error}\n"
    "  reset_gpu: {action: evict, severity: critical}\n"
    "  reboot_node: {action: evict, severity: critical}\n"
    "  contact_support: {action: evict, severity: critical}\n"
    "  ignore: {action: ignore, severity: info}\n"
    "unused: {action: diagnose, severity: warning}\n"
)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("codes:\n  - {code: 1, name: a, bucket: reboot}\n", "bucket 'reboot'"),
        ("codes:\n  - {code: 1, name: a, bucket: ignore, action: evict}\n", "needs 'why'"),
        ("codes:\n  - {code: 1, name: a, bucket: ignore}\n  - {code: 1, name: b, bucket: ignore}\n", "twice"),
        ("codes:\n  - {code: 0, name: a, bucket: ignore}\n", "positive integer"),
        ("codes:\n  - {code: 1, name: a, bucket: ignore, colour: red}\n", "needs code"),
        ("codes:\n  - {code: 1, name: a, bucket: ignore, action: panic, why: x}\n", "not an action"),
    ],
)
def test_bad_catalogs_are_clear_errors(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(XidCatalogError, match=message):
        load_xid_catalog(_catalog(tmp_path, HEAD + body))


def test_a_policy_must_cover_every_bucket(tmp_path: Path) -> None:
    text = HEAD.replace("  ignore: {action: ignore, severity: info}\n", "") + "codes: []\n"
    with pytest.raises(XidCatalogError, match="exactly the buckets"):
        load_xid_catalog(_catalog(tmp_path, text))


def test_the_catalog_file_ships_beside_the_rules() -> None:
    assert CATALOG_PATH.parent.parent.name == "rules" and CATALOG_PATH.is_file()
