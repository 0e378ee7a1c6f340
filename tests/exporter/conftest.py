"""Exporter test helpers: a writable copy of the fixture machine root and configs pointing at it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from trainguard.streams.exporter.config import ExporterConfig, load_exporter_config

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(autouse=True)
def _no_nccl_interface_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``nic`` source reads NCCL_SOCKET_IFNAME/NCCL_IB_HCA from its environment by default:
    a test's interfaces must not depend on the shell that runs it."""
    for var in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A private copy of ``fixtures/root`` (tests flip NICs and append kernel lines in it)."""
    dst = tmp_path / "root"
    shutil.copytree(FIXTURES / "root", dst, symlinks=True)
    return dst


def make_cfg(root: Path, state: Path, **sections: Any) -> ExporterConfig:
    """A config reading ``root``; nvml off unless asked (no GPU here), short socket path, no
    /metrics endpoint unless asked."""
    data: dict[str, Any] = {
        "node": "node-t",
        "job": "job-t",
        "root": str(root),
        "state_dir": str(state),
        "nvml": {"enabled": False},
        "kernel_log": {"path": str(root / "var/log/kern.log")},
        "reporter": {"socket": str(state / "r.sock")},
        "process": {"cmd_pattern": "train.py"},
        # No /metrics server unless a test asks for one: the default port (9401, every interface)
        # is the host's, not a test's to take.
        "metrics": {"port": 0},
    }
    for name, value in sections.items():
        data[name] = {**data.get(name, {}), **value} if isinstance(value, dict) else value
    return load_exporter_config(data, environ={})
