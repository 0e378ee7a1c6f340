"""One import root: everything is ``trainguard.<folder>``; ``trainguard.training`` stays light.

- No module of the project imports a bare ``schemas``/``detectors``/``streams``/``actions``/``infra``
  (those names belong to whatever else a training image installs).
- Importing ``trainguard.training`` loads the standard library and nothing else, and reporting a
  step loads nothing heavy either.
- A training repository with its own ``schemas/``, ``streams/`` and ``actions/`` packages first on
  ``sys.path`` still gets TrainGuard's, and ``trainguard exporter --once --print`` still runs there.
- The wheel's only top-level name is ``trainguard``.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OLD_ROOTS = ("schemas", "detectors", "streams", "actions", "infra")
#: what the training side must never load by itself.
HEAVY = ("faust", "aiokafka", "kafka", "clickhouse_connect", "plotly", "sklearn", "numpy", "torch", "mode")
SOURCE_DIRS = (
    "schemas",
    "detectors",
    "streams",
    "actions",
    "infra",
    "trainguard",
    "tests",
    "bench",
    "scripts",
    "demo",
)


def _python_files() -> list[Path]:
    files: list[Path] = []
    for top in SOURCE_DIRS:
        for path in (ROOT / top).rglob("*.py"):
            # trainguard/<folder> links to the top-level folders: each file once, by its real path.
            if path.resolve().is_relative_to(ROOT) and path.resolve() == path:
                files.append(path)
    return files


def _bare_imports(source: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in OLD_ROOTS]
    return found


def test_no_module_imports_the_old_roots() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in _python_files()
        for line, name in _bare_imports(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []


def test_the_checker_sees_a_bare_import() -> None:
    assert _bare_imports("import os\nfrom streams.reporter import Reporter\nimport infra.bus as b\n") == [
        (2, "streams.reporter"),
        (3, "infra.bus"),
    ]
    assert _bare_imports("from trainguard.streams import reporter\nfrom . import x\n") == []


def _run(code: str, cwd: Path, pythonpath: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


CLOSURE = """
import json, sys
before = set(sys.modules)
import trainguard.training
after_import = sorted(set(sys.modules) - before)
from trainguard.training import Reporter
rep = Reporter(job="j", rank=0, socket_path="/nonexistent/reporter.sock", capture_exceptions=False,
               flight_recorder=False)
rep.step(1, loss=1.0, tokens=10)
rep.close(exit_code=0)
print(json.dumps({"after_import": after_import, "after_use": sorted(sys.modules),
                  "stdlib": sorted(sys.stdlib_module_names)}))
"""


def test_training_api_imports_the_standard_library_only(tmp_path: Path) -> None:
    got = json.loads(_run(CLOSURE, cwd=tmp_path))
    stdlib = set(got["stdlib"])
    foreign = [
        m
        for m in got["after_import"]
        if m.split(".")[0] not in stdlib and m not in ("trainguard", "trainguard.training")
    ]
    assert foreign == []
    heavy = sorted({m.split(".")[0] for m in got["after_use"]} & set(HEAVY))
    assert heavy == []
    # Using the Reporter loads its own modules, never a service's.
    services = [
        m
        for m in got["after_use"]
        if m.startswith(("trainguard.actions", "trainguard.infra", "trainguard.detectors"))
    ]
    assert services == []


def test_training_api_exports() -> None:
    import trainguard.training as training

    for name in training.__all__:
        assert getattr(training, name).__name__ == name
    with pytest.raises(AttributeError):
        _ = training.NoSuchThing  # type: ignore[attr-defined]


def _shadowing_repo(tmp_path: Path) -> Path:
    """A training repository whose own packages reuse TrainGuard's folder names."""
    repo = tmp_path / "user-repo"
    for name in ("schemas", "streams", "actions", "detectors", "infra"):
        pkg = repo / name
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(f"USER_PACKAGE = {name!r}\n")
    (repo / "streams" / "reporter.py").write_text("raise ImportError('the user repo reporter, not ours')\n")
    return repo


def test_user_packages_of_the_same_names_do_not_shadow(tmp_path: Path) -> None:
    repo = _shadowing_repo(tmp_path)
    code = (
        "import schemas, streams; assert schemas.USER_PACKAGE == 'schemas'\n"
        "from trainguard.training import Reporter\n"
        "import trainguard.streams.reporter as r; assert 'user-repo' not in r.__file__\n"
        "print(Reporter.__module__)\n"
    )
    assert _run(code, cwd=repo, pythonpath=str(repo)).strip() == "trainguard.streams.reporter"


def test_exporter_once_print_beside_user_packages(tmp_path: Path) -> None:
    repo = _shadowing_repo(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["PYTHONPATH"] = str(repo)
    env["TRAINGUARD_HOME"] = str(tmp_path / "home")
    out = subprocess.run(
        [sys.executable, "-m", "trainguard", "exporter", "--node", "n0", "--job", "j", "--once", "--print"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert records, out.stdout
    assert all(r.get("node", "n0") == "n0" for r in records)


def _source_copy(dest: Path) -> Path:
    """The distribution's sources, links kept as links (setuptools' build/ then lands here)."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, dest / name)
    for name in ("trainguard", *OLD_ROOTS):
        shutil.copytree(
            ROOT / name, dest / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    return dest


def test_the_wheel_installs_trainguard_only(tmp_path: Path) -> None:
    src, out = _source_copy(tmp_path / "src"), tmp_path / "dist"
    pip_wheel = ["pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)]
    subprocess.run([sys.executable, "-m", *pip_wheel], check=True, timeout=300, capture_output=True)
    (wheel,) = out.glob("trainguard-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        tops = {n.split("/")[0] for n in names}
        top_level = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        declared = zf.read(top_level[0]).decode().split() if top_level else ["trainguard"]
    assert {t for t in tops if not t.endswith(".dist-info")} == {"trainguard"}
    assert declared == ["trainguard"]
    # The linked folders travel as packages, with their data files.
    for needed in (
        "trainguard/schemas/codec.py",
        "trainguard/streams/reporter.py",
        "trainguard/training.py",
        "trainguard/infra/clickhouse/migrations/",
    ):
        assert any(n.startswith(needed) for n in names), needed
    assert any(n.endswith("/LICENSE") for n in names)
