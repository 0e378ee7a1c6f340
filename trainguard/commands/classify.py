"""``trainguard classify-log``: run the explicit-fault rule table over a log file.

Operators use it to see what TrainGuard would recommend for a log, and to test a rule change
(``--rules my-rules.yaml``) before deploying it.  Lines are read in order through the
traceback-aware classifier, so the line carrying a traceback's final exception gets the
user-code classification.  ``--verdict`` judges the whole log instead: the earliest root cause
and its action (:func:`~trainguard.detectors.verdict.log_verdict`, the logic the worker applies
to a rank's stderr).
"""

from __future__ import annotations

import json
import re
from typing import IO

import click

from trainguard.detectors.log_classifier import Classification, LogClassifier, parse_timestamp
from trainguard.detectors.rule_table import RuleTable, RuleTableError, load_rule_table
from trainguard.detectors.verdict import LogVerdict, log_verdict

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
@click.option(
    "--verdict",
    "verdict",
    is_flag=True,
    help="Judge the whole log: its earliest root cause and the action for it (one result).",
)
@click.option(
    "--code-changed-at",
    "code_changed_at",
    metavar="LINE_NO|TIMESTAMP",
    help="With --verdict: the job's code or environment changed at this line (1-based) or time "
    "(ISO 8601 or epoch seconds); a software failure at or after it is a rollback.",
)
def classify_log(
    file: IO[str],
    as_json: bool,
    rules_path: str | None,
    matched_only: bool,
    width: int,
    verdict: bool,
    code_changed_at: str | None,
) -> None:
    """Classify each line of FILE ('-' for stdin) with the fault rule table.

    JSON mode prints, per input line, exactly {"line", "category", "severity", "action",
    "rule"}; action is one of evict, restart, rollback, diagnose, ignore, none (none: no rule
    matched, and category/severity/rule are null).  With --verdict, JSON mode prints one
    object for the whole log, exactly {"action", "category", "rule", "cause_line"}
    (cause_line: the text of the line naming the cause; null with action none).
    """
    try:
        table = load_rule_table(rules_path) if rules_path else None
    except RuleTableError as exc:
        raise click.ClickException(str(exc)) from None
    if code_changed_at is not None and not verdict:
        raise click.UsageError("--code-changed-at needs --verdict")
    if verdict:
        _verdict(file, table, as_json, width, code_changed_at)
        return
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


def _change_point(value: str | None) -> tuple[int | None, float | None]:
    """(line, ts) of ``--code-changed-at``: an integer is a line number, else a time."""
    if value is None:
        return None, None
    v = value.strip()
    if re.fullmatch(r"\d{1,9}", v):
        if int(v) < 1:
            raise click.BadParameter("a line number starts at 1", param_hint="--code-changed-at")
        return int(v), None
    if re.fullmatch(r"\d+\.\d*", v):
        return None, float(v)
    ts = parse_timestamp(v)
    if ts is None:
        raise click.BadParameter(
            f"{value!r} is neither a line number nor a timestamp", param_hint="--code-changed-at"
        )
    return None, ts


def _verdict(
    file: IO[str], table: RuleTable | None, as_json: bool, width: int, code_changed_at: str | None
) -> None:
    line, ts = _change_point(code_changed_at)
    v = log_verdict(file, table=table, code_changed_line=line, code_changed_ts=ts)
    if as_json:
        click.echo(json.dumps(v.to_json(), ensure_ascii=False))
        return
    click.echo(_verdict_text(v, width))


def _verdict_text(v: LogVerdict, width: int) -> str:
    if v.cause_line is None:
        return "verdict: none (no rule matched any line)"
    head = f"verdict: {v.action.value}  {v.category or '-'}  (rule {v.rule}, line {v.line_no}, {v.role})"
    text = v.cause_line if len(v.cause_line) <= width else v.cause_line[: width - 1] + "…"
    out = [click.style(head, fg=_ACTION_COLOURS.get(v.action.value)), f"cause:   {text}"]
    if v.consequences:
        out.append(f"then:    {v.consequences} more acting line(s)")
    out.extend(f"note:    {n}" for n in v.notes)
    return "\n".join(out)


COMMANDS: list[click.Command] = [classify_log]
