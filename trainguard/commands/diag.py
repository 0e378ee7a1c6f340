"""``trainguard diag``: run the node tests of :mod:`trainguard.diag` on this machine.

``trainguard diag [--level quick|standard|long] [--test NAME ...] [--json] [--out FILE]``

Output: with ``--json``, **JSON lines** on stdout -- one object per test, printed as soon as the
test ends (a long level shows progress; a killed run keeps the results so far), each
``{"test", "passed", "skipped_reason", "measured", "thresholds", "duration_s", "findings"}``
(``passed`` null: skipped).  Without ``--json``, one line per test for a person, findings below
it.  ``--out FILE`` writes the JSON lines to FILE as well, whichever is printed.

Exit status: 0 when every test passed or was skipped, 1 when one failed, 2 for a bad invocation
(an unknown test, a bad ``--set``, an invalid config).

Settings: the level's preset, then ``--diag-config FILE`` (YAML, sections per test), then
``TRAINGUARD_DIAG__<SECTION>__<KEY>`` variables, then ``--set SECTION.KEY=VALUE`` and the
dedicated flags (:mod:`trainguard.diag.config`).
"""

from __future__ import annotations

import json
from typing import IO, Any

import click

from trainguard.diag import LEVEL_TESTS, LEVELS, REGISTRY, DiagContext, DiagResult, run_tests
from trainguard.diag.config import DiagConfig, load_diag_config
from trainguard.schemas.config import ConfigError, deep_merge, load_yaml_file


def _split_tests(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """``--test a --test b,c`` -> (a, b, c), each a registered test."""
    names = tuple(n.strip() for v in value for n in v.split(",") if n.strip())
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise click.BadParameter(
            f"unknown test(s) {', '.join(map(repr, unknown))}; the tests are: {', '.join(REGISTRY)}"
        )
    return tuple(dict.fromkeys(names))  # in the order given, each once


def _set_overrides(specs: tuple[str, ...]) -> dict[str, Any]:
    """``--set memory.size_mib=512`` -> {"memory": {"size_mib": 512}} (values parsed as YAML)."""
    import yaml

    data: dict[str, Any] = {}
    for spec in specs:
        key, sep, raw = spec.partition("=")
        section, dot, field = key.strip().partition(".")
        if not sep or not dot or not section or not field:
            raise click.BadParameter(f"{spec!r}: expected SECTION.KEY=VALUE", param_hint="--set")
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        data = deep_merge(data, {section.replace("-", "_"): {field: value}})
    return data


def _human(result: DiagResult) -> str:
    word = {True: "PASS", False: "FAIL", None: "SKIP"}[result.passed]
    colour = {True: "green", False: "red", None: "yellow"}[result.passed]
    line = f"{click.style(f'{word:<5}', fg=colour)} {result.test:<12} {result.duration_s:8.1f} s"
    if result.passed is None:
        line += f"  {result.skipped_reason}"
    for finding in result.findings:
        line += f"\n      - {finding}"
    return line


def _progress(quiet: bool) -> Any:
    def say(message: str) -> None:
        if not quiet:
            click.echo(message, err=True)

    return say


@click.command("diag")
@click.option(
    "--level",
    type=click.Choice(list(LEVELS)),
    default="quick",
    show_default=True,
    help="quick (~30 s), standard (a few minutes) or long: the tests run and their sizes.",
)
@click.option(
    "--test",
    "tests",
    multiple=True,
    callback=_split_tests,
    metavar="NAME",
    help=f"Run this test (repeatable, or comma-separated) instead of the level's: {', '.join(REGISTRY)}.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per test on stdout (JSON lines).")
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False, writable=True),
    help="Also write the JSON lines to this file.",
)
@click.option(
    "--diag-config",
    type=click.Path(exists=True, dir_okay=False),
    help="YAML file of DiagConfig settings (one section per test).",
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="Override one setting, e.g. memory.size_mib=512 or gpu_health.max_pcie_replays=100 (repeatable).",
)
@click.option(
    "--expected-digest", metavar="SHA256", help="gemm-digest: the digest every device must produce."
)
@click.option(
    "--expected-file",
    type=click.Path(exists=True, dir_okay=False),
    help="gemm-digest: a file with one digest, or a JSON object recipe -> digest.",
)
@click.option("--list", "list_", is_flag=True, help="List the tests and the levels that run them, and exit.")
@click.pass_context
def diag(
    ctx: click.Context,
    level: str,
    tests: tuple[str, ...],
    as_json: bool,
    out_path: str | None,
    diag_config: str | None,
    overrides: tuple[str, ...],
    expected_digest: str | None,
    expected_file: str | None,
    list_: bool,
) -> None:
    """Test this node's GPUs, memory and interconnect; one result per test.

    Exits 0 when every test passed or was skipped, 1 when one failed, 2 on a bad invocation.
    """
    if list_:
        for name, reg in REGISTRY.items():
            levels = ",".join(lv for lv, names in LEVEL_TESTS.items() if name in names) or "-"
            click.echo(f"{name:<12} [{levels}]  {reg.summary}")
        return
    cfg = _config(level, diag_config, overrides, expected_digest, expected_file)
    root_obj = ctx.find_root().obj
    quiet = isinstance(root_obj, dict) and bool(root_obj.get("quiet"))
    names = tests or LEVEL_TESTS[level]
    out: IO[str] | None = open(out_path, "w", encoding="utf-8") if out_path else None  # noqa: SIM115
    failed = passed = skipped = 0
    try:
        for result in run_tests(names, DiagContext(cfg=cfg, progress=_progress(quiet))):
            line = json.dumps(result.to_json(), sort_keys=False, default=str)
            if out is not None:
                out.write(line + "\n")
                out.flush()  # each result on disk as soon as it is known
            click.echo(line if as_json else _human(result))
            failed += result.passed is False
            passed += result.passed is True
            skipped += result.passed is None
    finally:
        if out is not None:
            out.close()
    if not as_json:
        click.echo(f"diag {level}: {passed} passed, {failed} failed, {skipped} skipped", err=True)
    if failed:
        ctx.exit(1)


def _config(
    level: str,
    diag_config: str | None,
    overrides: tuple[str, ...],
    expected_digest: str | None,
    expected_file: str | None,
) -> DiagConfig:
    data: dict[str, Any] = {}
    try:
        if diag_config:
            data = load_yaml_file(diag_config)
        flags = _set_overrides(overrides)
        gemm: dict[str, Any] = {}
        if expected_digest is not None:
            gemm["expected_digest"] = expected_digest
        if expected_file is not None:
            gemm["expected_file"] = expected_file
        if gemm:
            flags = deep_merge(flags, {"gemm_digest": gemm})
        return load_diag_config(level, deep_merge(data, flags))
    except ConfigError as exc:
        # A bad setting is a bad invocation (exit 2), never mistaken for a failing node (exit 1).
        raise click.UsageError(str(exc)) from None


COMMANDS: list[click.Command] = [diag]
