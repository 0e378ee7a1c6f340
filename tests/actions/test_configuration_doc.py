"""``docs/configuration.md`` against the config dataclasses it documents, and the ``trainguard
actions run`` options that point at it.

Each documented class has one section (its heading names the class) whose table lists exactly the
class's fields, each with the default the code has (as JSON, which is also YAML; a nested
dataclass is documented in its own section, its default cell says "below").  A field added,
renamed, dropped or given another default without the doc fails here.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from trainguard.actions.config import ActionsConfig, BreakerConfig, StepPolicy
from trainguard.actions.executors.dry_run import DryRunConfig
from trainguard.actions.executors.kubernetes import KubernetesExecutorConfig
from trainguard.actions.executors.slurm import SlurmExecutorConfig
from trainguard.actions.node_config import NodeReturnConfig
from trainguard.cli import main
from trainguard.detectors.placement.config import PlacementConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
DOCUMENTED = (
    ActionsConfig,
    StepPolicy,
    BreakerConfig,
    PlacementConfig,
    DryRunConfig,
    SlurmExecutorConfig,
    KubernetesExecutorConfig,
    NodeReturnConfig,
)
#: a table row: | `key` | default | what it does |
_ROW = re.compile(r"^\| `(\w+)` \| (.*?) \| (.*) \|$")


def sections(text: str) -> dict[str, str]:
    """Heading line -> the text up to the next heading."""
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def rows(section: str) -> dict[str, tuple[str, str]]:
    """key -> (default cell, description) of a section's table."""
    found = {}
    for line in section.splitlines():
        m = _ROW.match(line.strip())
        if m:
            assert m.group(1) not in found, f"{m.group(1)} documented twice"
            found[m.group(1)] = (m.group(2), m.group(3))
    return found


def default_cell(f: dataclasses.Field[Any]) -> str:
    """What the doc must show as ``f``'s default."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    else:
        assert f.default_factory is not dataclasses.MISSING, f"{f.name} has no default"
        value = f.default_factory()
    return "below" if dataclasses.is_dataclass(value) else f"`{json.dumps(value)}`"


@pytest.mark.parametrize("cls", DOCUMENTED, ids=lambda c: c.__name__)
def test_every_field_is_documented_with_its_default(cls: type) -> None:
    heads = [h for h in sections(DOC.read_text()) if f"({cls.__name__})" in h]
    assert len(heads) == 1, f"one section of {DOC.name} names ({cls.__name__}): {heads}"
    table = rows(sections(DOC.read_text())[heads[0]])
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert sorted(table) == sorted(fields), f"{heads[0]}: documented keys differ from {cls.__name__}'s fields"
    for name, f in fields.items():
        cell, what = table[name]
        code = default_cell(f)
        assert cell == code, f"{cls.__name__}.{name}: the doc says {cell}, the code {code}"
        assert len(what.split()) >= 3, f"{cls.__name__}.{name}: say what it does"


def test_nested_settings_have_their_own_sections() -> None:
    heads = " ".join(sections(DOC.read_text()))
    for f in dataclasses.fields(ActionsConfig):
        if default_cell(f) == "below":
            assert f"`actions.{f.name}`" in heads, f"actions.{f.name} has no section"


def test_actions_run_help_lists_its_options_and_where_settings_come_from() -> None:
    res = CliRunner().invoke(main, ["actions", "run", "--help"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    for said in ("--job NAME", "--executor NAME", "--state-dir", "--print-config", "TRAINGUARD_CONFIG",
                 "TRAINGUARD__ACTIONS__<KEY>", "docs/configuration.md", "Unknown keys are errors"):  # fmt: skip
        assert said in text, said


def test_print_config_shows_file_env_and_options_in_their_order(tmp_path: Path) -> None:
    config = tmp_path / "trainguard.yaml"
    config.write_text("actions:\n  jobs: [from-file]\n  executor: slurm\n  executor_options: {user: alice}\n")
    env = {
        "TRAINGUARD_HOME": str(tmp_path / "home"),
        "TRAINGUARD_CONFIG": str(config),
        "TRAINGUARD__ACTIONS__EXECUTOR_OPTIONS": "{tasks_per_node: 8}",
        "TRAINGUARD__ACTIONS__BREAKER__WINDOW_S": "30",
    }
    res = CliRunner().invoke(main, ["actions", "run", "--job", "llm", "--print-config"], env=env)
    assert res.exit_code == 0, res.output
    shown = json.loads(res.stdout)["actions"]
    assert (shown["jobs"], shown["executor"], shown["breaker"]["window_s"]) == (["llm"], "slurm", 30.0)
    # The executor's options: the file's and the variable's, merged, and every default beside them.
    options = shown["executor_options"]
    assert (options["user"], options["tasks_per_node"]) == ("alice", 8)
    assert options["keep_steps"] == ["tg-exporter"]
    assert f"state in {tmp_path / 'home' / 'actions'}" in res.stderr

    # An option the executor does not have is an error naming it, before anything runs.
    env["TRAINGUARD__ACTIONS__EXECUTOR_OPTIONS"] = "{tasks_per_nod: 8}"
    res = CliRunner().invoke(main, ["actions", "run", "--print-config"], env=env)
    assert res.exit_code != 0 and "tasks_per_nod" in res.output
