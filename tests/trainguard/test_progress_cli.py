"""``trainguard replay`` and ``record`` show their progress on stderr and leave stdout as it was (what
scripts parse); ``trainguard --quiet`` shows none.  Against the real broker, in the shadow topic
namespace (no live worker reads it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.infra.test_replay_shadow import _steps_recording
from tests.streams.harness import unique
from trainguard.cli import main
from trainguard.infra.config import Settings
from trainguard.infra.progress import ENV, INTERVAL_ENV
from trainguard.infra.replay import read_recording
from trainguard.schemas.topics import STEPS

pytestmark = pytest.mark.slow

#: the one line a short run leaves in a log (stderr is not a terminal here): count, time, rate.
FINAL = r"{label}: {count} records  \[in \d+(\.\d)?s(, [\d.,]+ records/s|, [\d.]+s each)?\]\n"


@pytest.fixture(autouse=True)
def _progress_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(INTERVAL_ENV, raising=False)


def _recording(tmp_path: Path, job: str) -> Path:
    return _steps_recording(tmp_path, job)[1]  # five steps, the replay tests' recording


def test_replay_shows_progress_on_stderr_only(stack_settings: Settings, tmp_path: Path) -> None:
    recording = _recording(tmp_path, unique("progress-replay"))
    res = CliRunner().invoke(main, ["replay", str(recording), "--speed", "0"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert res.stdout == "replayed 5 record(s) into trainguard.shadow.*\n"
    assert re.fullmatch(FINAL.format(label="replay", count=5), res.stderr), res.stderr

    quiet = CliRunner().invoke(main, ["--quiet", "replay", str(recording), "--speed", "0"])
    assert quiet.exit_code == 0, quiet.output
    assert (quiet.stdout, quiet.stderr) == (res.stdout, "")
    off = CliRunner().invoke(main, ["replay", str(recording), "--speed", "0"], env={ENV: "0"})
    assert (off.stdout, off.stderr) == (res.stdout, "")


def test_record_shows_progress_on_stderr_only(stack_settings: Settings, tmp_path: Path) -> None:
    job = unique("progress-record")
    res = CliRunner().invoke(main, ["replay", str(_recording(tmp_path, job)), "--speed", "0"])
    assert res.exit_code == 0, res.output
    out = tmp_path / "recorded.jsonl"
    res = CliRunner().invoke(
        main,
        ["record", "--namespace", "shadow", "--topics", STEPS.name, "--since", "2", "--out", str(out)],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    n = sum(1 for _ in read_recording(out))
    assert sum(1 for r in read_recording(out) if r["key"] == job) == 5
    assert res.stdout == f"recorded {n} record(s) from 1 topic(s) into {out}\n"
    assert re.fullmatch(FINAL.format(label="record", count=f"{n:,}"), res.stderr), res.stderr
