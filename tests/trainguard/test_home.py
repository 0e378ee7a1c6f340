"""One stack home: the same from every working directory, ``$TRAINGUARD_HOME`` honoured, and a
command that does not find something there says which home it looked in and what chose it."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from trainguard.commands.keys import keys
from trainguard.context import friendly_errors, settings
from trainguard.infra.config import default_home, home_origin, load_settings
from trainguard.schemas.config import ConfigError

#: the variables that choose a home, unset (CliRunner removes a variable given as None).
UNSET: dict[str, str | None] = {
    "TRAINGUARD_HOME": None,
    "TRAINGUARD__STACK__HOME": None,
    "TRAINGUARD_CONFIG": None,
    "XDG_DATA_HOME": None,
}


def _dirs(tmp_path: Path, *names: str) -> list[Path]:
    out = [tmp_path / name for name in names]
    for d in out:
        d.mkdir(parents=True)
    return out


def test_the_default_home_is_the_users_from_every_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"HOME": str(tmp_path / "ada")}
    homes = set()
    for cwd in _dirs(tmp_path, "a", "b/deeper"):
        monkeypatch.chdir(cwd)
        homes.add(load_settings(environ=env).stack.home_path)
    assert homes == {tmp_path.resolve() / "ada" / ".local" / "share" / "trainguard"}
    xdg = {**env, "XDG_DATA_HOME": str(tmp_path / "data")}
    assert load_settings(environ=xdg).stack.home_path == tmp_path.resolve() / "data" / "trainguard"
    # a relative XDG_DATA_HOME is invalid (the XDG spec): ignored, not taken from the directory
    assert default_home({**env, "XDG_DATA_HOME": "data"}) == default_home(env)
    assert home_origin(load_settings(environ=env)) == "the default; $TRAINGUARD_HOME sets another"


def test_trainguard_home_and_stack_home_choose_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (cwd,) = _dirs(tmp_path, "work")
    monkeypatch.chdir(cwd)
    env = {"HOME": str(tmp_path / "ada"), "TRAINGUARD_HOME": str(tmp_path / "site")}
    s = load_settings(environ=env)
    assert (s.stack.home_path, home_origin(s)) == (tmp_path.resolve() / "site", "set by $TRAINGUARD_HOME")
    # a relative one is the caller's choice: relative to where it was given
    s = load_settings(environ={**env, "TRAINGUARD_HOME": "here"})
    assert s.stack.home_path == cwd.resolve() / "here"
    conf = tmp_path / "tg.yaml"
    conf.write_text(f"stack:\n  home: {tmp_path / 'from-yaml'}\n")
    s = load_settings(conf, environ={"HOME": str(tmp_path / "ada")})
    assert (s.stack.home_path, home_origin(s)) == (
        tmp_path.resolve() / "from-yaml",
        "set by stack.home in the config file",
    )
    s = load_settings(environ={**env, "TRAINGUARD__STACK__HOME": str(tmp_path / "var")})
    assert (s.stack.home_path, home_origin(s)) == (
        tmp_path.resolve() / "var",
        "set by $TRAINGUARD__STACK__HOME",
    )


def test_keys_are_found_from_any_directory_and_a_miss_names_the_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = CliRunner().invoke
    env = {**UNSET, "HOME": str(tmp_path / "ada")}
    home = tmp_path.resolve() / "ada" / ".local" / "share" / "trainguard"
    here, there = _dirs(tmp_path, "here", "there/deeper")
    monkeypatch.chdir(here)
    missing = run(keys, ["show"], env=env)
    assert missing.exit_code == 1, missing.output
    assert f"no trusted keys at {home}/keys/trusted.yaml" in missing.output
    assert f"stack home {home} (the default; $TRAINGUARD_HOME sets another)" in missing.output
    assert run(keys, ["init"], env=env).exit_code == 0
    monkeypatch.chdir(there)
    shown = run(keys, ["show"], env=env)
    assert shown.exit_code == 0 and shown.output.startswith(f"{home}/keys/trusted.yaml:"), shown.output
    # another home, named by TRAINGUARD_HOME: looked for there, and said so
    other = tmp_path.resolve() / "other"
    nokey = run(keys, ["export-public", "worker"], env={**env, "TRAINGUARD_HOME": str(other)})
    assert nokey.exit_code == 1
    assert f"no signing key at {other}/keys/worker.key" in nokey.output
    assert f"stack home {other} (set by $TRAINGUARD_HOME)" in nokey.output


def test_any_commands_miss_in_the_home_names_it(tmp_path: Path) -> None:
    @click.command()
    @click.pass_context
    @friendly_errors
    def probe(ctx: click.Context) -> None:
        raise ConfigError(f"no signing key at {settings(ctx).stack.home_path / 'keys' / 'actions.key'}")

    @click.command()
    @click.pass_context
    @friendly_errors
    def elsewhere(ctx: click.Context) -> None:
        settings(ctx)
        raise ConfigError("no signing key at /etc/trainguard/keys/actions.key")

    env = {**UNSET, "TRAINGUARD_HOME": str(tmp_path)}
    res = CliRunner().invoke(probe, env=env)
    assert res.exit_code == 1 and f"stack home {tmp_path.resolve()} (set by $TRAINGUARD_HOME)" in res.output
    res = CliRunner().invoke(elsewhere, env=env)
    assert res.exit_code == 1 and "stack home" not in res.output  # a path outside the home: no note
