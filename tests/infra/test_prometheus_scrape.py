"""A real Prometheus scrapes a real stream worker, node exporter and action service (integration).

The worker is ``trainguard worker`` in a subprocess (tests/streams/harness.py), the exporter
``trainguard exporter --metrics-port`` in a subprocess reading the fixture machine, the action
service runs in a thread; all against the local stack's broker.  Prometheus (the Debian package,
scripts/setup.sh) scrapes them every second with the shipped alert rules loaded, and the test asks
its HTTP API what a dashboard or an alert would: every target up, an exporter per-source metric,
a worker metric and the action service's recoveries have values, and every rule evaluates
without error against the real series.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.exporter.conftest import FIXTURES
from tests.infra.metric_names import DEPLOY
from tests.net import free_ports
from tests.streams.harness import WorkerProcess, unique
from tests.waiting import wait_until
from trainguard.actions.config import ActionsConfig
from trainguard.actions.executors.base import ExecutorEnv
from trainguard.actions.executors.dry_run import DryRunConfig, DryRunExecutor
from trainguard.actions.service import ActionService
from trainguard.infra.config import Settings

pytestmark = pytest.mark.slow

JOBS = ("trainguard-worker", "trainguard-exporter", "trainguard-actions")


class Prometheus:
    """``prometheus`` on 127.0.0.1:``port`` with a one-second scrape and rule interval."""

    def __init__(self, tmp: Path, port: int, targets: dict[str, int]) -> None:
        exe = shutil.which("prometheus")
        assert exe, "prometheus is needed: run scripts/setup.sh (the Debian package prometheus)"
        self.port, self.log = port, tmp / "prometheus.log"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(DEPLOY / "prometheus" / "trainguard-alerts.yml")],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{p}"]}]}
                for job, p in targets.items()
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    exe,
                    f"--config.file={tmp / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def api(self, path: str, **params: str) -> Any:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def value(self, query: str) -> float | None:
        """The first sample of an instant query (None: no series, or Prometheus not answering yet)."""
        try:
            result = self.api("query", query=query)["result"]
        except OSError:
            return None
        return float(result[0]["value"][1]) if result else None

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def start_exporter(tmp: Path, port: int) -> tuple[subprocess.Popen[bytes], Path]:
    """``trainguard exporter`` on a private copy of the fixture machine, /metrics on ``port``."""
    root = tmp / "root"
    shutil.copytree(FIXTURES / "root", root, symlinks=True)
    state, log = tmp / "exporter", tmp / "exporter.log"
    exe = Path(sys.executable).with_name("trainguard")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                str(exe),
                "exporter",
                f"--node={unique('prom-node')}",
                "--job=prom-job",
                f"--root={root}",
                f"--kernel-log={root / 'var/log/kern.log'}",
                f"--state-dir={state}",
                f"--socket={state / 'r.sock'}",
                "--disable=nvml",
                "--disable=process",
                f"--metrics-port={port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, log


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the exporter drains its spool for up to 10 s
        try:
            proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture
def action_service(stack_settings: Settings, tmp_path: Path) -> Iterator[int]:
    """An action service in a thread serving /metrics; yields its port."""
    (port,) = free_ports(1)
    cfg = ActionsConfig(
        group_id=unique("tg-prom-actions"),
        jobs=[unique("prom-job")],
        state_dir=str(tmp_path / "actions"),
        poll_interval_s=0.2,
        metrics_host="127.0.0.1",
        metrics_port=port,
    )
    executor = DryRunExecutor(DryRunConfig(), ExecutorEnv(state_dir=tmp_path / "actions" / "executor"))
    service = ActionService(stack_settings, cfg, executor=executor)
    service.start_consuming()
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,), name="actions", daemon=True)
    thread.start()
    yield port
    stop.set()
    thread.join(30)


@pytest.mark.timeout(600)
def test_prometheus_scrapes_every_component_and_evaluates_the_rules(
    stack_settings: Settings, tmp_path: Path, action_service: int
) -> None:
    worker_port, exporter_port, prometheus_port = free_ports(3)
    worker = WorkerProcess(unique("tg-prom"), worker_port, tmp_path / "worker.log", settings=stack_settings)
    exporter, exporter_log = start_exporter(tmp_path, exporter_port)
    prometheus: Prometheus | None = None
    try:
        worker.start()  # until it answers a probe: its agents have counted events
        assert exporter.poll() is None, exporter_log.read_text(errors="replace")[-3000:]
        targets = dict(zip(JOBS, (worker_port, exporter_port, action_service), strict=True))
        prometheus = Prometheus(tmp_path, prometheus_port, targets)
        prom = prometheus

        def all_up() -> bool:
            try:
                active = prom.api("targets")["activeTargets"]
            except OSError:
                return False  # not listening yet
            return sorted(t["labels"]["job"] for t in active if t["health"] == "up") == sorted(JOBS)

        wait_until(
            all_up,
            120,
            lambda: (
                f"all three targets up; prometheus says {prom.api('targets')['activeTargets']}\n"
                f"exporter log: {exporter_log.read_text(errors='replace')[-2000:]}"
            ),
            interval_s=0.5,
        )
        queries = {
            # An exporter per-source metric: the host source's successful rounds.
            'trainguard_exporter_collections_total{job="trainguard-exporter", source="host", outcome="ok"}': 1,
            'trainguard_exporter_source_last_success_timestamp_seconds{source="kernel_log"}': 1,
            "trainguard_exporter_records_spooled_total": 1,
            # A worker metric: the events its agents handled (its start-up probe at least).
            'sum(trainguard_agent_events_total{job="trainguard-worker"})': 1,
            # The action service's recoveries, read from its store at every scrape.
            'sum(trainguard_actions_recoveries{job="trainguard-actions"})': 0,
        }
        for query, at_least in queries.items():
            wait_until(
                lambda q=query, n=at_least: (v := prom.value(q)) is not None and v >= n,
                60,
                lambda q=query: f"{q} to have a value in Prometheus (now {prom.value(q)})",
                interval_s=0.5,
            )

        # The shipped rules are loaded and evaluate against these series without error.
        def evaluated() -> list[dict[str, Any]] | None:
            rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
            return rules if rules and all(r["health"] == "ok" for r in rules) else None

        rules = wait_until(
            evaluated,
            60,
            lambda: (
                f"every rule evaluated: {[(r['name'], r['health'], r.get('lastError')) for g in prom.api('rules')['groups'] for r in g['rules']]}"
            ),
            interval_s=0.5,
        )
        shipped = yaml.safe_load((DEPLOY / "prometheus" / "trainguard-alerts.yml").read_text())
        assert len(rules) == sum(len(g["rules"]) for g in shipped["groups"])
        # Everything is up: the alerts about components being down are quiet.
        firing = {a["labels"]["alertname"] for a in prom.api("alerts")["alerts"] if a["state"] == "firing"}
        assert not firing & {"TrainGuardWorkersDown", "TrainGuardActionServiceDown", "TrainGuardExporterDown"}
    finally:
        if prometheus is not None:
            prometheus.stop()
        stop_process(exporter)
        worker.stop()
