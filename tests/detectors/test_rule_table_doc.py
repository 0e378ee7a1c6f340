"""docs/reference/rule-table.md lists exactly the rows of ``detectors/rules/*.yaml``: a row added
to or removed from a file and not from the page fails here (the files stay the source)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "reference" / "rule-table.md"


def test_the_page_lists_every_rule_id_once() -> None:
    in_files = [r["id"] for f in sorted((REPO / "detectors" / "rules").glob("*.yaml"))
                for r in yaml.safe_load(f.read_text())["rules"]]  # fmt: skip
    on_page = re.findall(r"^\| `([\w.-]+)` \|", DOC.read_text(), flags=re.MULTILINE)
    assert sorted(on_page) == sorted(in_files)


def test_the_page_is_what_the_script_makes() -> None:
    """``scripts/rule_table_doc.py`` regenerates the rows section; the page is its output."""
    import subprocess
    import sys

    script = REPO / "scripts" / "rule_table_doc.py"
    res = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, timeout=60)
    assert res.returncode == 0, "run scripts/rule_table_doc.py to bring the page up to date"
