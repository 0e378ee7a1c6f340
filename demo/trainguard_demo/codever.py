"""The job's code version: ``<cluster_dir>/code/current``, switched in place and rolled back.

A version names a module under :mod:`trainguard_demo.versions` (``v2-buggy`` ->
``versions/v2_buggy.py``).  Ranks read the version at start and re-read it whenever the file
changes (a lazy in-place hot update, ByteRobust §6.1), so writing ``v2-buggy`` makes every rank
raise its ``TypeError`` within a step; :func:`rollback` restores the version before it, from
``code/history`` (one version a line, oldest first).

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> current_version(d)
'v1'
>>> set_version(d, "v2-buggy"); current_version(d)
'v2-buggy'
>>> rollback(d), current_version(d)
('v1', 'v1')
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

from trainguard_demo.config import ClusterPaths, write_atomic

DEFAULT_VERSION = "v1"
KNOWN_VERSIONS = ("v1", "v2-buggy", "v3")


def _dir(cluster_dir: str | os.PathLike[str]) -> Path:
    return ClusterPaths(Path(cluster_dir)).code_dir()


def current_version(cluster_dir: str | os.PathLike[str]) -> str:
    path = _dir(cluster_dir) / "current"
    try:
        return path.read_text().strip() or DEFAULT_VERSION
    except FileNotFoundError:
        return DEFAULT_VERSION


def _history(cluster_dir: str | os.PathLike[str]) -> list[str]:
    try:
        return (_dir(cluster_dir) / "history").read_text().split()
    except FileNotFoundError:
        return []


def set_version(cluster_dir: str | os.PathLike[str], version: str) -> None:
    """Switch the job to ``version`` (the previous one is remembered for :func:`rollback`)."""
    if version not in KNOWN_VERSIONS:
        raise ValueError(f"unknown code version {version!r}; known: {', '.join(KNOWN_VERSIONS)}")
    history = _history(cluster_dir) or [current_version(cluster_dir)]
    write_atomic(_dir(cluster_dir) / "history", "\n".join([*history, version]) + "\n")
    write_atomic(_dir(cluster_dir) / "current", version + "\n")


def rollback(cluster_dir: str | os.PathLike[str]) -> str:
    """Go back to the version before the current one; returns it (``v1`` if none is known)."""
    history = _history(cluster_dir)
    previous = history[-2] if len(history) >= 2 else DEFAULT_VERSION
    write_atomic(_dir(cluster_dir) / "history", "\n".join([*history[:-1]] or [previous]) + "\n")
    write_atomic(_dir(cluster_dir) / "current", previous + "\n")
    return previous


def load(version: str) -> ModuleType:
    if version not in KNOWN_VERSIONS:
        raise ValueError(f"unknown code version {version!r}; known: {', '.join(KNOWN_VERSIONS)}")
    return importlib.import_module(f"trainguard_demo.versions.{version.replace('-', '_')}")


class CodeWatcher:
    """Reloads the version module when ``code/current`` changes (checked with one stat per step)."""

    def __init__(self, cluster_dir: str | os.PathLike[str]) -> None:
        self._path = _dir(cluster_dir) / "current"
        self._cluster_dir = cluster_dir
        self._stamp: tuple[int, int] | None = None
        self.version = current_version(cluster_dir)
        self.module = load(self.version)

    def poll(self) -> bool:
        """True when the version changed (and :attr:`module` now holds the new code)."""
        try:
            st = self._path.stat()
            stamp = (st.st_mtime_ns, st.st_ino)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        version = current_version(self._cluster_dir)
        if version == self.version:
            return False
        self.version, self.module = version, load(version)
        return True
