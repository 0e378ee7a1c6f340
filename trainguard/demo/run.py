"""`trainguard demo`: a real PyTorch job on a local "cluster" that survives injected faults.

Starts the stack, one stream worker, the action service (local executor) and M machines plus
warm standbys -- each machine with its own node exporter reading its own kernel log and sysfs
tree -- runs the tiny-GPT job (tp2 pp2 dp2 over 4 machines by default), injects the scenario's
faults one after another (each once the job is healthy again), shows live progress, and ends
with the timeline of every incident and the ETTR computed from ClickHouse.

The baseline ETTR is **modelled, not run**: the same incidents, each detected only by a fixed
timeout and recovered by a cold requeue of the whole job that loses the work since the last
periodic checkpoint (parameters in :class:`BaselineModel`); running the scenario a second time
would double the demo's length on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import yaml

from infra.bus import EventProducer
from infra.clickhouse.postmortem import ettr, incidents
from infra.clickhouse.store import ClickHouseStore
from infra.config import Settings
from infra.stack.manager import Stack
from schemas.base import now_ms
from schemas.control import JobSpec
from schemas.topics import JOBS
from trainguard.demo.config import JobSpec as DemoSpec
from trainguard.demo.inject import inject, kernel_log, prepare_machine_root
from trainguard.demo.launcher import launch_job, launch_standby, read_progress, standby_ready

DEFAULT_SCENARIO: list[dict[str, Any]] = [
    {"fault": "xid", "machine": 0},
    {"fault": "user-error", "machine": 1},
    {"fault": "nan", "machine": 2},
    {"fault": "crash", "machine": 3},
    {"fault": "oom", "machine": 0},
    {"fault": "nic-flap", "machine": 1},
    {"fault": "hang", "machine": 3},
    {"fault": "hang-dataloader", "machine": 2},
    {"fault": "hang-checkpoint", "machine": 1},
    {"fault": "slow", "machine": 2},
    {"fault": "nic-down", "machine": 0},
    {"fault": "gpu-lost", "machine": 3},
]


@dataclass(frozen=True)
class BaselineModel:
    """The incumbent: detect by a fixed timeout, requeue the whole job cold (see module doc)."""

    detect_timeout_s: float = 600.0  # PyTorch distributed's default collective timeout
    requeue_s: float = 600.0  # reschedule + rebuild environment + reload from remote storage (§3.3)
    checkpoint_every_steps: int = 100  # BLOOM/ByteCheckpoint-style periodic checkpoints
    step_s: float = 1.0


@dataclass
class DemoConfig:
    machines: int = 4
    tp: int = 2
    pp: int = 2
    dp: int = 2
    ranks_per_machine: int = 2
    standbys: int = 2
    steps: int = 100_000
    stall_s: float = 15.0
    incident_timeout_s: float = 150.0
    settle_steps: int = 5
    web_port: int = 16400
    baseline: BaselineModel = field(default_factory=BaselineModel)


class Demo:
    def __init__(
        self, settings: Settings, cfg: DemoConfig, scenario: list[dict[str, Any]], out: Any = click.echo
    ):
        self.settings, self.cfg, self.scenario, self.echo = settings, cfg, scenario, out
        run_id = time.strftime("%Y%m%d-%H%M%S")
        self.job = f"demo-{run_id}"
        self.dir = settings.stack.home_path / "demo" / run_id
        self.cluster = self.dir / "cluster"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.t0 = time.time()

    # -- processes ------------------------------------------------------------------------------
    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = self.dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            p = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        self.procs.append(p)
        return p

    def _tg(self) -> list[str]:
        return [str(Path(sys.executable).with_name("trainguard"))]

    def _exporter(self, machine: str) -> None:
        root = prepare_machine_root(self.cluster, machine)
        pattern = rf"trainguard\.demo\.(trainer|standby) .*--machine {machine}( |$)"
        self._spawn(
            f"exporter-{machine}",
            [
                *self._tg(),
                "exporter",
                "--node",
                machine,
                "--job",
                self.job,
                "--root",
                str(root),
                "--kernel-log",
                str(kernel_log(self.cluster, machine)),
                "--state-dir",
                str(self.cluster / "machines" / machine / "exporter"),
                "--socket",
                str(self.cluster / "machines" / machine / "reporter.sock"),
                "--cmd-pattern",
                pattern,
                "--simulate-gpus",
                "8",
                "--interval",
                "nic=5",
            ],
        )

    def _config_file(self) -> Path:
        cfg = {
            "worker": {
                "app_id": f"{self.job}-worker",
                "web_port": self.cfg.web_port,
                "auto_offset_reset": "latest",
                "check_interval_s": 1.0,
                "monitor": {"stall": {"stall_s": self.cfg.stall_s}},
                "aggregation": {
                    "deadline_s": 8.0,
                    "cooldown_s": 10.0,
                    "fail_slow_rounds": 3,
                    "fail_slow_interval_s": 3.0,
                },
                "decide": {"dedup_window_s": 60.0},
                # Every demo "machine" shares this host's CPUs: its load says nothing about one machine.
                "host": {"cpu_overload_action": "ignore"},
            },
            "actions": {
                "executor": "local",
                "executor_options": {"cluster_dir": str(self.cluster)},
                "state_dir": str(self.dir / "actions"),
                "jobs": [self.job],
                "min_standbys": self.cfg.standbys,
                "escalation_window_s": 0.0,
                "max_restarts": 100,
                "max_evictions_per_job_hour": 100,
            },
        }
        path = self.dir / "trainguard.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(cfg))
        return path

    # -- the run --------------------------------------------------------------------------------
    def start(self) -> DemoSpec:
        from infra.stack.procs import port_in_use

        if port_in_use(self.cfg.web_port):
            raise click.ClickException(
                f"port {self.cfg.web_port} is in use: is another demo still running? (stop it first)"
            )
        self.echo(f"[demo] stack: {Stack(self.settings).up().seconds:.1f}s; run dir {self.dir}")
        env = {"TRAINGUARD_CONFIG": str(self._config_file())}
        self._spawn("worker", [*self._tg(), "worker"], env)
        self._spawn("actions", [*self._tg(), "actions", "run"], env)
        machines = [f"m{i}" for i in range(self.cfg.machines)]
        standbys = [f"standby-init-{i}" for i in range(self.cfg.standbys)]
        spec = DemoSpec(
            job=self.job,
            cluster_dir=str(self.cluster),
            tp=self.cfg.tp,
            pp=self.cfg.pp,
            dp=self.cfg.dp,
            ranks_per_machine=self.cfg.ranks_per_machine,
            machines=machines,
            steps=self.cfg.steps,
            master_port=29690,
            resume=True,
            pg_timeout_s=60.0,
        )
        for m in machines + standbys:
            self._exporter(m)
        (self.cluster / "jobs").mkdir(parents=True, exist_ok=True)
        (self.cluster / "jobs" / f"{self.job}.json").write_text(spec.to_json())
        for s in standbys:
            launch_standby(self.cluster, s, spec.ranks_per_machine)
        producer = EventProducer(self.settings.kafka)
        producer.send(
            JobSpec(job=self.job, ts_ms=now_ms(), topology=spec.topology(), standbys=standbys), JOBS
        )
        producer.flush()
        producer.close()
        self._wait_worker()
        launch_job(spec)
        self.echo(
            f"[demo] job {self.job}: tp{spec.tp} pp{spec.pp} dp{spec.dp} on {machines}, standbys {standbys}"
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not all(standby_ready(self.cluster, s, 2) for s in standbys):
            time.sleep(1)
        self._wait_steps(self.cfg.settle_steps, 240)
        return spec

    def _wait_worker(self) -> None:
        import urllib.request

        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.cfg.web_port}/healthz", timeout=1)
                time.sleep(8)  # consumer group join before the first events matter
                return
            except OSError:
                time.sleep(1)
        raise click.ClickException(f"stream worker did not start; see {self.dir / 'logs' / 'worker.log'}")

    def spec(self) -> DemoSpec:
        return DemoSpec.from_json((self.cluster / "jobs" / f"{self.job}.json").read_text())

    def progress(self) -> tuple[int, float | None]:
        prog = read_progress(self.spec())
        steps = [p.get("step", -1) for p in prog.values()]
        losses = [p.get("loss") for p in prog.values() if p.get("loss") is not None]
        return (
            min(steps) if len(steps) == self.spec().tp * self.spec().pp * self.spec().dp else -1,
            losses[0] if losses else None,
        )

    def _wait_steps(self, n: int, timeout_s: float, start: int | None = None) -> bool:
        base = self.progress()[0] if start is None else start
        deadline = time.monotonic() + timeout_s
        last_print = 0.0
        while time.monotonic() < deadline:
            step, loss = self.progress()
            if step >= base + n:
                return True
            if time.monotonic() - last_print > 5:
                last_print = time.monotonic()
                shown = "-" if loss is None else f"{loss:.3f}"
                self.echo(
                    f"[{time.time() - self.t0:6.0f}s] step {step:>5}  loss {shown}  {self._recovery_line()}"
                )
            time.sleep(0.5)
        return False

    def _recovery_line(self) -> str:
        try:
            out = subprocess.run(
                [*self._tg(), "actions", "status", "--job", self.job, "--json"],
                capture_output=True,
                text=True,
                timeout=10,
                env={**os.environ, "TRAINGUARD_CONFIG": str(self.dir / "trainguard.yaml")},
            )
            rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip().startswith("{")]
        except (subprocess.SubprocessError, ValueError):
            return ""
        return f"recoveries {len(rows)}; last: {rows[-1].get('state', '?')}" if rows else "no recovery yet"

    def run(self) -> dict[str, Any]:
        self.start()
        injected: list[dict[str, Any]] = []
        for item in self.scenario:
            names = self.spec().machine_names()
            m = item["machine"]
            machine = names[m % len(names)] if isinstance(m, int) else str(m)
            step_before = self.progress()[0]
            at = time.time()
            what = inject(self.cluster, machine, item["fault"], job=self.job, settings=self.settings)
            self.echo(f"[{at - self.t0:6.0f}s] INJECT {item['fault']:<16} {what}")
            ok = self._wait_steps(self.cfg.settle_steps + 2, self.cfg.incident_timeout_s, start=step_before)
            injected.append({"fault": item["fault"], "machine": machine, "injected_at": at, "progressed": ok})
            if item["fault"] in ("slow",):
                from trainguard.demo.faults import clear_faults

                clear_faults(self.cluster, machine)  # a persistent slowdown ends with its eviction or here
        time.sleep(3)  # the sink's last batch
        return self.summary(injected)

    def summary(self, injected: list[dict[str, Any]]) -> dict[str, Any]:
        store = ClickHouseStore(self.settings.clickhouse)
        incs = incidents(store, job=self.job)
        out_incidents = []
        for k, inj in enumerate(injected):
            t_ms = int(inj["injected_at"] * 1000)
            t_next = int(injected[k + 1]["injected_at"] * 1000) if k + 1 < len(injected) else 1 << 62
            mine = [i for i in incs if t_ms <= i.decided_ts_ms < t_next]
            first = mine[0] if mine else None
            det = store.query(
                "SELECT min(ts_ms) FROM detections FINAL WHERE job = %(j)s AND ts_ms >= %(t)s "
                "AND ts_ms < %(n)s AND action NOT IN ('none', 'ignore')",
                {"j": self.job, "t": t_ms, "n": t_next},
            )
            det_ms = int(det[0][0]) if det and det[0][0] else None
            rec = next((i for i in mine if i.recovered_ts_ms), None)
            out_incidents.append(
                {
                    "fault": inj["fault"],
                    "machine": inj["machine"],
                    "injected_at": round(inj["injected_at"], 3),
                    "detected_s": round((det_ms - t_ms) / 1000, 2) if det_ms else None,
                    "decided_s": round((first.decided_ts_ms - t_ms) / 1000, 2) if first else None,
                    "recovered_s": round((rec.recovered_ts_ms - t_ms) / 1000, 2)
                    if rec and rec.recovered_ts_ms
                    else None,
                    "action": first.action if first else None,
                    "recovered": bool(rec) and inj["progressed"],
                }
            )
        e = ettr(store, self.job)
        return {
            "job": self.job,
            "ettr": round(e.ettr, 4),
            "baseline_ettr": round(self.baseline(e, len(injected)), 4),
            "productive_s": round(e.productive_s, 1),
            "wall_s": round(e.wall_s, 1),
            "incidents": out_incidents,
        }

    def baseline(self, e: Any, n_incidents: int) -> float:
        b = self.cfg.baseline
        lost_work = b.checkpoint_every_steps / 2 * b.step_s  # on average half a checkpoint interval
        downtime = n_incidents * (b.detect_timeout_s + b.requeue_s + lost_work)
        return e.productive_s / (e.productive_s + downtime) if e.productive_s > 0 else 0.0

    def stop(self) -> None:
        import signal

        subprocess.run(["pkill", "-f", "--", f"--cluster-dir {self.cluster}"], check=False)
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def print_timeline(summary: dict[str, Any], echo: Any = click.echo) -> None:
    echo("\nIncident timeline (seconds after injection)")
    echo(f"{'fault':<17}{'machine':<16}{'detected':>9}{'decided':>9}{'recovered':>10}  {'action':<10}ok")
    for i in summary["incidents"]:

        def f(v: Any) -> str:
            return "-" if v is None else f"{v:.1f}"

        echo(
            f"{i['fault']:<17}{i['machine']:<16}{f(i['detected_s']):>9}{f(i['decided_s']):>9}"
            f"{f(i['recovered_s']):>10}  {i['action']!s:<10}{'yes' if i['recovered'] else 'NO'}"
        )
    echo(
        f"\nETTR (ClickHouse): {summary['ettr']:.1%} over {summary['wall_s']:.0f}s wall "
        f"({summary['productive_s']:.0f}s productive)"
    )
    echo(f"Baseline ETTR (modelled: timeout detection + cold requeue): {summary['baseline_ettr']:.1%}")
