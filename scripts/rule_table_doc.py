"""Regenerate the "The rows" section of docs/reference/rule-table.md from detectors/rules/*.yaml.

    .venv/bin/python scripts/rule_table_doc.py          # rewrite the page in place
    .venv/bin/python scripts/rule_table_doc.py --check  # exit 1 if the page is stale

The YAML files are the source; ``tests/detectors/test_rule_table_doc.py`` checks the page lists
every row, and this script is how the page follows a change of the files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "reference" / "rule-table.md"
RULES = REPO / "detectors" / "rules"
HEADING = "## The rows\n"


def _first_sentence(text: str) -> str:
    text = " ".join(str(text).split())
    cut = text.find(". ")
    return text if cut < 0 else text[: cut + 1]


def _matches(row: dict[str, Any]) -> str:
    parts = []
    if "xid" in row:
        codes = row["xid"] if isinstance(row["xid"], list) else [row["xid"]]
        parts.append("Xid " + ", ".join(str(c) for c in codes))
    if row.get("patterns"):
        parts.append(f"{len(row['patterns'])} pattern(s)")
    if "when" in row:
        source = row.get("source", "log")
        when = json.dumps(row["when"], separators=(", ", ": ")).replace('"', "")
        parts.append(f"`{source}`; `{when}`")
    return "; ".join(parts) or "-"


def _threshold(row: dict[str, Any]) -> str:
    if "count" not in row:
        return "-"
    window = f" in {row['window_s']:g} s" if "window_s" in row else ""
    return f"{row['count']}{window}, else `{row.get('below_action', 'ignore')}`"


def section() -> str:
    out = [
        HEADING,
        "Generated from the YAML files (`scripts/rule_table_doc.py`: id, what it matches, category,",
        "action, and the threshold below which it recommends its `below_action`); the files are the",
        "source, and `tests/detectors/test_rule_table_doc.py` fails when a row is added or removed",
        "there and not here. Each row's description and example lines are in its file.",
        "",
    ]
    for path in sorted(RULES.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        out += [f"### [`{path.name}`](../../detectors/rules/{path.name})", ""]
        if doc.get("description"):
            out += [_first_sentence(doc["description"]), ""]
        out += ["| id | matches | category | action | threshold |", "|---|---|---|---|---|"]
        for row in doc["rules"]:
            out.append(
                f"| `{row['id']}` | {_matches(row)} | `{row.get('category', '-')}` | "
                f"`{row.get('action', '-')}` | {_threshold(row)} |"
            )
        out.append("")
    return "\n".join(out)


def render(page: str) -> str:
    """The page with its rows section (to the end of the page) regenerated."""
    head, sep, _ = page.partition(HEADING)
    if not sep:
        raise SystemExit(f"{DOC}: no {HEADING.strip()!r} heading")
    return head + section()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the page is not up to date")
    args = p.parse_args()
    page = DOC.read_text()
    new = render(page)
    if args.check:
        sys.exit(0 if new == page else 1)
    DOC.write_text(new)


if __name__ == "__main__":
    main()
