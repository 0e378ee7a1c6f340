"""``trainguard classify-log``: run the explicit-fault rule table over a log file.

Operators use it to see what TrainGuard would recommend for a log, and to test a rule change
(``--rules my-rules.yaml``) before deploying it.  Lines are read in order through the
traceback-aware classifier, so the line carrying a traceback's final exception gets the
user-code classification.
"""

from __future__ import annotations

import json
from typing import IO

import click

from trainguard.detectors.log_classifier import Classification, LogClassifier
from trainguard.detectors.rule_table import RuleTableError, load_rule_table

_ACTION_COLOURS = {"evict": "red", "rollback": "magenta", "diagnose": "yellow", "restart": "cyan"}


def _table_row(n: int, c: Classification, width: int) -> str:
    line = c.line if len(c.line) <= width else c.line[: width - 1] + "…"
    sev = c.severity.value if c.severity else "-"
    return f"{n:>6}  {c.action.value:<8}  {sev:<8}  {c.category or '-':<22}  {c.rule or '-':<22}  {line}"


@click.command("classify-log")
@click.argument("file", type=click.File("r", encoding="utf-8", errors="replace", lazy=False))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per input line.")
@click.option(
    "--rules",
    "rules_path",
    type=click.Path(exists=True),
    help="Alternate rule table: one YAML file or a directory of them (default: built-in).",
)
@click.option("--matched-only", is_flag=True, help="Text mode: show only lines some rule matched.")
@click.option("--width", default=100, show_default=True, help="Text mode: truncate lines to this width.")
def classify_log(
    file: IO[str], as_json: bool, rules_path: str | None, matched_only: bool, width: int
) -> None:
    """Classify each line of FILE ('-' for stdin) with the fault rule table.

    JSON mode prints, per input line, exactly {"line", "category", "severity", "action",
    "rule"}; action is one of evict, restart, rollback, diagnose, ignore, none (none: no rule
    matched, and category/severity/rule are null).
    """
    try:
        table = load_rule_table(rules_path) if rules_path else None
    except RuleTableError as exc:
        raise click.ClickException(str(exc)) from None
    clf = LogClassifier(table)
    counts: dict[str, int] = {}
    if not as_json:
        click.echo(f"{'line':>6}  {'action':<8}  {'severity':<8}  {'category':<22}  {'rule':<22}  text")
    for n, raw in enumerate(file, start=1):
        c = clf.feed(raw.rstrip("\r\n"))
        counts[c.action.value] = counts.get(c.action.value, 0) + 1
        if as_json:
            click.echo(json.dumps(c.to_json(), ensure_ascii=False))
        elif c.matched or not matched_only:
            row = _table_row(n, c, width)
            click.echo(click.style(row, fg=_ACTION_COLOURS.get(c.action.value)) if c.matched else row)
    if not as_json:
        summary = ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
        click.echo(f"-- {sum(counts.values())} lines: {summary or 'empty input'}", err=True)


COMMANDS: list[click.Command] = [classify_log]
