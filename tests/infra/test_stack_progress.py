"""What ``stack up`` shows while it resolves the broker's jars (Maven's output summarised) and while
it builds Kubernetes (Go modules downloaded, from the build log); a stand-in ``mvn`` on PATH, no
network and no servers."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from trainguard.infra.config import StackConfig
from trainguard.infra.progress import ENV, Progress
from trainguard.infra.stack.k8s import _LogWatch
from trainguard.infra.stack.kafka import KafkaServer, MavenOutput
from trainguard.infra.stack.procs import StackError

REPO = "https://repo.maven.apache.org/maven2/org/apache/kafka"
MAVEN_LINES = [
    "[INFO] Scanning for projects...",
    f"[INFO] Downloading from central: {REPO}/kafka_2.13/4.1.1/kafka_2.13-4.1.1.pom",
    f"[INFO] Downloaded from central: {REPO}/kafka_2.13/4.1.1/kafka_2.13-4.1.1.pom (3.4 kB at 12 kB/s)",
    f"Downloaded from central: {REPO}/kafka_2.13/4.1.1/kafka_2.13-4.1.1.jar (6.5 MB at 20 MB/s)",
    "[INFO] Copying kafka_2.13-4.1.1.jar to /tmp/libs.partial/kafka_2.13-4.1.1.jar",
    "[INFO] BUILD SUCCESS",
]


def test_mavens_output_is_counted() -> None:
    out = MavenOutput()
    for line in MAVEN_LINES:
        out.feed(line + "\n")
    assert (out.downloaded, out.copied) == (2, 1)
    assert out.summary() == "2 file(s) downloaded (6.5 MB), 1 jar(s) copied"
    # no [ERROR] line: the tail is the message
    assert out.errors().splitlines()[-1] == "[INFO] BUILD SUCCESS"
    out.feed("[ERROR] Failed to execute goal on project trainguard-kafka-broker: Could not resolve\n")
    assert out.errors() == (
        "[ERROR] Failed to execute goal on project trainguard-kafka-broker: Could not resolve"
    )


def _fake_mvn(bin_dir: Path, exit_code: int = 0) -> None:
    """An ``mvn`` that prints Maven's lines and writes the broker jar into -DoutputDirectory."""
    bin_dir.mkdir()
    echo = "".join(f"echo '{line}'\n" for line in MAVEN_LINES)
    script = bin_dir / "mvn"
    script.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do case "$a" in -DoutputDirectory=*) out="${a#-DoutputDirectory=}";; esac; done\n'
        + echo
        + ('touch "$out/kafka_2.13-4.1.1.jar"\n' if exit_code == 0 else "echo '[ERROR] no network'\n")
        + f"exit {exit_code}\n"
    )
    script.chmod(0o755)


def test_resolving_the_jars_shows_mavens_downloads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    _fake_mvn(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    server = KafkaServer(StackConfig(home=str(tmp_path / "home"), cache_dir=str(tmp_path / "cache")))
    shown = io.StringIO()
    bar = Progress("stack up", stream=shown, interval_s=0)  # a log line for every update
    libs = server.ensure_jars(bar)
    assert (libs / ".complete").exists() and (libs / "kafka_2.13-4.1.1.jar").exists()
    lines = shown.getvalue().splitlines()
    assert all(
        ln.startswith("stack up: kafka: resolving the broker's jars with Maven (once)  [") for ln in lines
    )
    assert [ln.split("]  ")[-1] for ln in lines] == [
        "0 file(s) downloaded",
        "0 file(s) downloaded",
        "1 file(s) downloaded (3 kB)",
        "2 file(s) downloaded (6.5 MB)",
        "2 file(s) downloaded (6.5 MB), 1 jar(s) copied",
        "2 file(s) downloaded (6.5 MB), 1 jar(s) copied",
    ]
    shown.truncate(0)
    assert server.ensure_jars(bar) == libs and shown.getvalue() == ""  # cached: no phase, no Maven


def test_a_failed_resolve_says_mavens_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_mvn(tmp_path / "bin", exit_code=1)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    server = KafkaServer(StackConfig(home=str(tmp_path / "home"), cache_dir=str(tmp_path / "cache")))
    with pytest.raises(StackError, match=r"\(exit 1\):\n\[ERROR\] no network$"):
        server.ensure_jars()


def test_the_go_build_log_is_read_for_module_downloads(tmp_path: Path) -> None:
    log = tmp_path / "kube-apiserver.build.log"
    watch = _LogWatch(log)
    assert watch.poll() == 0  # not written yet
    log.write_bytes(b"go: downloading k8s.io/api v0.34.1\ngo: downloading k8s.io/apimachinery v0.3")
    assert watch.poll() == 1  # the second line is not complete yet
    with log.open("ab") as fh:
        fh.write(b"4.1\ngo: finding module for package x\ngo: downloading sigs.k8s.io/yaml v1.4.0\n")
    assert watch.poll() == 3
