"""`trainguard demo`: a real PyTorch job on a local "cluster" that survives injected faults.

Starts the stack, one stream worker, the action service (local executor) and M machines plus
warm standbys -- each machine with its own node exporter reading its own kernel log and sysfs
tree -- runs the tiny-GPT job (tp2 pp2 dp2 over 4 machines by default), injects the scenario's
faults one after another (each after ``gap_s`` of healthy training following the previous
recovery), shows live progress, and ends with the timeline of every incident and the ETTR
computed from ClickHouse.

Timeline columns, all measured from ClickHouse and relative to the injection: *detected* (the
first actionable detection, or the machine's own NIC finding for a flap that is tolerated),
*localised* (the first decision that names the culprit machines), *decided* (the first decision
that starts a recovery), *recovered* (the first training step after the last of those recoveries
ended: training is running again, not merely "the action service is done").

The **baseline** runs at the same time, for real: a second job of the same shape on its own
machines (``b0``..), with its own exporters so its steps reach ClickHouse the same way, no
TrainGuard action (the action service only acts for the TrainGuard job), and
:class:`~trainguard_demo.baseline.BaselineSupervisor` as its only recovery: a fixed no-progress
timeout, then a cold requeue from the last periodic checkpoint.  Every fault is injected into
both jobs at the same moment (same kind, same machine index), and both ETTRs are computed by
the same query.  Both jobs share the two cores, so each runs at about half speed: the comparison
is fair, the absolute step rate is not the point.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import click
import yaml

from infra.bus import EventProducer
from infra.clickhouse.postmortem import ettr, sliding_ettr
from infra.clickhouse.store import ClickHouseStore
from infra.config import Settings
from infra.stack.manager import Stack
from schemas.base import now_ms
from schemas.control import JobSpec
from schemas.topics import JOBS
from trainguard_demo.config import JobSpec as DemoSpec
from trainguard_demo.inject import inject
from trainguard_demo.launcher import launch_job, new_pool, read_progress, standby_ready, start_zygote
from trainguard_demo.node import exporter_argv

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


@dataclass
class DemoConfig:
    machines: int = 4
    tp: int = 2
    pp: int = 2
    dp: int = 2
    ranks_per_machine: int = 2
    standbys: int = 2
    steps: int = 100_000
    stall_s: float = 6.0
    incident_timeout_s: float = 150.0
    settle_steps: int = 5
    #: healthy training between one fault's recovery and the next injection.
    gap_s: float = 40.0
    #: how long a fault that need not stop the job (slow, flap) is watched before moving on.
    watch_s: float = 35.0
    #: new warm pools wait this long before importing torch.
    warm_delay_s: float = 6.0
    web_port: int = 16400
    #: run the baseline job next to TrainGuard's (``--no-baseline``: TrainGuard's job alone).
    baseline: bool = True
    baseline_timeout_s: float = 30.0
    baseline_checkpoint_every: int = 50


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
        self._ch: ClickHouseStore | None = None
        self.bcluster = self.dir / "baseline-cluster"
        self.baseline: Any = None  # the BaselineSupervisor, when the baseline runs
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
        self._spawn(f"exporter-{machine}", exporter_argv(self.cluster, machine, self.job))

    def _config_file(self) -> Path:
        cfg = {
            "worker": {
                "app_id": f"{self.job}-worker",
                "web_port": self.cfg.web_port,
                "auto_offset_reset": "latest",
                "check_interval_s": 1.0,
                "monitor": {
                    "stall": {"stall_s": self.cfg.stall_s},
                    # Eight ranks share two cores here: a rank 10-20% slower than the median is
                    # noise from its neighbours (restarts, warm pools), not a failing machine.
                    "straggler": {"min_slowdown": 1.5},
                    # Fail-slow shows as the job's MFU falling: a 4x slower rank drops it by 75%,
                    # the baseline job's cold restarts on the same cores mostly by less than 65%.
                    "mfu": {"decline_frac": 0.65, "sustain": 8, "warmup": 20},
                },
                "aggregation": {
                    "deadline_s": 8.0,
                    "cooldown_s": 10.0,
                    # Five rounds 2 s apart: a straggler must be the root of 3 of them.
                    "fail_slow_rounds": 5,
                    "fail_slow_interval_s": 2.0,
                },
                # Duplicates of one incident (every rank reporting the same NaN or crash) arrive
                # within seconds; the next incident of the same kind may come a minute later.
                "decide": {"dedup_window_s": 20.0},
                # Every demo "machine" shares this host's CPUs: its load says nothing about one machine.
                "host": {"cpu_overload_action": "ignore"},
            },
            "actions": {
                "executor": "local",
                "executor_options": {
                    "cluster_dir": str(self.cluster),
                    "stop_grace_s": 1.0,
                    "warm_delay_s": self.cfg.warm_delay_s,
                },
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
        for m in machines + standbys:  # each machine's zygote forks its warm pools (see zygote)
            start_zygote(self.cluster, m)
        producer = EventProducer(self.settings.kafka)
        producer.send(
            JobSpec(job=self.job, ts_ms=now_ms(), topology=spec.topology(), standbys=standbys), JOBS
        )
        producer.flush()
        producer.close()
        self._wait_worker()
        launch_job(spec)
        if self.cfg.baseline:  # at once: both jobs warm up (and learn their step times) under one load
            self._start_baseline(spec)
        for m in machines + standbys:  # queued until the zygote is ready; the first restart is warm too
            new_pool(self.cluster, m, spec.ranks_per_machine)
        self.echo(
            f"[demo] job {self.job}: tp{spec.tp} pp{spec.pp} dp{spec.dp} on {machines}, standbys {standbys}"
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not all(standby_ready(self.cluster, s, 2) for s in standbys):
            time.sleep(1)
        self._wait_steps(self.cfg.settle_steps, 240)
        return spec

    def _start_baseline(self, spec: DemoSpec) -> None:
        with warnings.catch_warnings():  # torch.cuda's notice about pynvml, on a CPU-only demo
            warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
            from trainguard_demo.baseline import BaselineConfig, BaselineSupervisor

        machines = [f"b{i}" for i in range(self.cfg.machines)]
        bspec = replace(
            spec,
            job=f"{self.job}-baseline",
            cluster_dir=str(self.bcluster),
            machines=machines,
            master_port=29950,
        )
        for m in machines:
            self._spawn(f"exporter-{m}", exporter_argv(self.bcluster, m, bspec.job))
        self.baseline = BaselineSupervisor(
            bspec,
            BaselineConfig(
                port_base=29951,
                timeout_s=self.cfg.baseline_timeout_s,
                checkpoint_every=self.cfg.baseline_checkpoint_every,
            ),
        ).start()
        self.echo(f"[demo] baseline job {bspec.job} on {machines}: timeout detection + cold requeue")

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
        spec = self.spec()  # the job's current machines (a restart may have changed them)
        prog = read_progress(spec)
        steps = [p.get("step", -1) for p in prog.values()]
        losses = [p.get("loss") for p in prog.values() if p.get("loss") is not None]
        return (min(steps) if len(steps) == spec.world_size else -1, losses[0] if losses else None)

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
        """The action service's view, read from its progress store (SQLite allows a reader next
        to the writer) rather than by a ``trainguard actions status`` process every few seconds."""
        from actions.progress import ProgressStore

        path = self.dir / "actions" / "progress.sqlite"
        if not path.exists():
            return "no recovery yet"
        store = ProgressStore(path)
        try:
            recs = store.recoveries(self.job, limit=30)
        finally:
            store.close()
        return f"recoveries {len(recs)}; last: {recs[-1].state.value}" if recs else "no recovery yet"

    def _store(self) -> ClickHouseStore:
        if self._ch is None:
            self._ch = ClickHouseStore(self.settings.clickhouse)
        return self._ch

    def _recoveries_since(self, t_ms: int) -> list[tuple[str, str, str, int]]:
        """(decision_id, action, last recovery phase, its ts_ms) of decisions since ``t_ms``."""
        rows = self._store().query(
            # One row per decision on each side: ANY JOIN keeps a single right-hand match.
            "SELECT decision_id, d.action, a.phase, a.ts FROM "
            "(SELECT decision_id, any(action) AS action FROM decisions FINAL "
            " WHERE job = %(j)s AND ts_ms >= %(t)s GROUP BY decision_id) AS d ANY INNER JOIN "
            "(SELECT decision_id, argMax(phase, ts_ms) AS phase, max(ts_ms) AS ts FROM action_events FINAL "
            " WHERE job = %(j)s AND step = 'recovery' GROUP BY decision_id) AS a USING decision_id",
            {"j": self.job, "t": t_ms},
        )
        return [(str(d), str(a), str(p), int(t)) for d, a, p, t in rows]

    def _wait_handled(self, kind: str, at: float, step_before: int) -> bool:
        """Wait until every recovery the fault caused has ended and training is past the fault."""
        t_ms = int(at * 1000)
        deadline = time.monotonic() + self.cfg.incident_timeout_s
        watch_until = at + {"slow": self.cfg.watch_s, "nic-flap": 10.0}.get(kind, 3.0)
        last_print = 0.0
        while time.monotonic() < deadline:
            step, loss = self.progress()
            recs = self._recoveries_since(t_ms)
            acting = [r for r in recs if r[1] not in ("aggregate", "none", "ignore")]
            open_ = [r for r in acting if r[2] == "started"]
            ended = max((r[3] for r in acting), default=t_ms)
            resumed = step >= step_before + self.cfg.settle_steps and (
                not acting or self._step_after(ended) is not None
            )
            if kind == "slow" and any(r[1] == "evict" for r in acting):
                watch_until = min(watch_until, time.time())  # the slow machine is gone
            if not open_ and resumed and time.time() >= watch_until:
                return True
            if time.monotonic() - last_print > 5:
                last_print = time.monotonic()
                self._show(step, loss)
            time.sleep(0.5)
        return False

    def _step_after(self, ts_ms: int) -> int | None:
        rows = self._store().query(
            "SELECT min(ts_ms) FROM training_steps WHERE job = %(j)s AND rank = 0 AND ts_ms > %(t)s",
            {"j": self.job, "t": ts_ms},
        )
        return int(rows[0][0]) if rows and rows[0][0] else None

    def _show(self, step: int, loss: float | None) -> None:
        shown = "-" if loss is None else f"{loss:.3f}"
        self.echo(f"[{time.time() - self.t0:6.0f}s] step {step:>5}  loss {shown}  {self._recovery_line()}")

    def _healthy_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        last_print = time.monotonic()
        while time.monotonic() < end:
            time.sleep(0.5)
            if time.monotonic() - last_print > 5:
                last_print = time.monotonic()
                self._show(*self.progress())

    def run(self) -> dict[str, Any]:
        self.start()
        injected: list[dict[str, Any]] = []
        for item in self.scenario:
            self._healthy_for(float(item.get("after_s", self.cfg.gap_s)))
            names = self.spec().machine_names()
            m = item["machine"]
            machine = names[m % len(names)] if isinstance(m, int) else str(m)
            step_before = self.progress()[0]
            at = time.time()
            what = inject(self.cluster, machine, item["fault"], job=self.job, settings=self.settings)
            if self.baseline is not None:  # the same fault on the same machine index of the baseline
                bnames = self.baseline.spec.machine_names()
                bmachine = bnames[names.index(machine) % len(bnames)] if machine in names else bnames[0]
                inject(self.bcluster, bmachine, item["fault"], job=self.baseline.spec.job)
            self.echo(f"[{at - self.t0:6.0f}s] INJECT {item['fault']:<16} {what}")
            ok = self._wait_handled(item["fault"], at, step_before)
            injected.append({"fault": item["fault"], "machine": machine, "injected_at": at, "progressed": ok})
            if item["fault"] == "slow":
                from trainguard_demo.faults import clear_faults

                clear_faults(self.cluster, machine)  # a persistent slowdown ends with its eviction or here
                if self.baseline is not None:
                    for b in self.baseline.spec.machine_names():
                        clear_faults(self.bcluster, b)
        self._healthy_for(10.0)  # the last recovery's steps reach ClickHouse
        return self.summary(injected)

    def _first(self, sql: str, t_ms: int, t_next: int, **params: Any) -> int | None:
        rows = self._store().query(sql, {"j": self.job, "t": t_ms, "n": t_next, **params})
        return int(rows[0][0]) if rows and rows[0][0] else None

    def summary(self, injected: list[dict[str, Any]]) -> dict[str, Any]:
        out_incidents = []
        for k, inj in enumerate(injected):
            t_ms = int(inj["injected_at"] * 1000)
            t_next = int(injected[k + 1]["injected_at"] * 1000) if k + 1 < len(injected) else 1 << 62
            det_ms = self._first(
                "SELECT min(ts_ms) FROM detections FINAL WHERE job = %(j)s AND ts_ms >= %(t)s "
                "AND ts_ms < %(n)s AND (action NOT IN ('none', 'ignore') "
                "OR (node = %(m)s AND kind LIKE 'nic-%%'))",
                t_ms, t_next, m=inj["machine"],
            )  # fmt: skip
            loc_ms = self._first(
                "SELECT min(ts_ms) FROM decisions FINAL WHERE job = %(j)s AND ts_ms >= %(t)s "
                "AND ts_ms < %(n)s AND notEmpty(machines) AND action NOT IN ('none', 'ignore')",
                t_ms, t_next,
            )  # fmt: skip
            recs = [r for r in self._recoveries_since(t_ms) if r[3] < t_next]
            acting = sorted(
                (r for r in recs if r[1] not in ("aggregate", "none", "ignore")), key=lambda r: r[3]
            )
            dec_ms = self._first(
                "SELECT min(ts_ms) FROM decisions FINAL WHERE job = %(j)s AND ts_ms >= %(t)s "
                "AND ts_ms < %(n)s AND has(%(ids)s, decision_id)",
                t_ms, t_next, ids=[r[0] for r in acting] or [""],
            )  # fmt: skip
            real = [r for r in acting if r[2] == "succeeded" and not self._superseded(r[0])]
            rec_ms = self._step_after(max(r[3] for r in real)) if real else None
            action = self._action_of(real[0][0]) if real else None
            failed = [r for r in acting if r[2] in ("failed", "held")]

            def s(ms: int | None) -> float | None:
                return None if ms is None else round((ms - t_ms) / 1000, 2)  # noqa: B023

            out_incidents.append(
                {
                    "fault": inj["fault"],
                    "machine": inj["machine"],
                    "injected_at": round(inj["injected_at"], 3),
                    "detected_s": s(det_ms),
                    "localised_s": s(loc_ms),
                    "decided_s": s(dec_ms),
                    "recovered_s": s(rec_ms),
                    "action": action or ("tolerated" if det_ms and not acting else None),
                    "recovered": inj["progressed"] and not failed,
                }
            )
        e = ettr(self._store(), self.job)
        out: dict[str, Any] = {
            "job": self.job,
            "ettr": round(e.ettr, 4),
            "baseline_ettr": None,
            "productive_s": round(e.productive_s, 1),
            "wall_s": round(e.wall_s, 1),
            "sliding_ettr_min": _min_sliding(self._store(), self.job),
            "incidents": out_incidents,
        }
        if self.baseline is not None:
            b = ettr(self._store(), self.baseline.spec.job)
            out["baseline_ettr"] = round(b.ettr, 4)
            out["baseline"] = {
                "job": self.baseline.spec.job,
                "productive_s": round(b.productive_s, 1),
                "wall_s": round(b.wall_s, 1),
                "requeues": self.baseline.requeues,
                "incidents": self.baseline.incidents(),
            }
        return out

    def _superseded(self, decision_id: str) -> bool:
        rows = self._store().query(
            "SELECT count() FROM action_events FINAL WHERE decision_id = %(d)s AND step = 'recovery' "
            "AND (detail LIKE 'superseded%%' OR detail LIKE 'ignored%%')",
            {"d": decision_id},
        )
        return bool(rows and rows[0][0])

    def _action_of(self, decision_id: str) -> str | None:
        rows = self._store().query(
            "SELECT detail FROM action_events FINAL WHERE decision_id = %(d)s AND step = 'recovery' "
            "AND phase = 'started'",
            {"d": decision_id},
        )
        detail = str(rows[0][0]) if rows else ""
        return detail.split("path=")[1].split()[0] if "path=" in detail else None

    def stop(self) -> None:
        import signal

        if self.baseline is not None:
            self.baseline.stop()
        # Ranks, warm pools and the exporters of provisioned machines all name the cluster dir.
        subprocess.run(["pkill", "-f", "--", str(self.cluster)], check=False)
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def _min_sliding(store: ClickHouseStore, job: str) -> float | None:
    """The lowest 1-hour sliding ETTR (windows start at the first step: a run shorter than an hour
    gives the ETTR of every prefix)."""
    windows = sliding_ettr(store, job)
    return round(min(w for _, w in windows), 4) if windows else None


def print_timeline(summary: dict[str, Any], echo: Any = click.echo) -> None:
    echo("\nIncident timeline (seconds after injection)")
    echo(
        f"{'fault':<17}{'machine':<16}{'detected':>9}{'localised':>10}{'decided':>9}{'recovered':>10}"
        f"  {'action':<10}ok"
    )
    for i in summary["incidents"]:

        def f(v: Any) -> str:
            return "-" if v is None else f"{v:.1f}"

        echo(
            f"{i['fault']:<17}{i['machine']:<16}{f(i['detected_s']):>9}{f(i['localised_s']):>10}"
            f"{f(i['decided_s']):>9}"
            f"{f(i['recovered_s']):>10}  {i['action']!s:<10}{'yes' if i['recovered'] else 'NO'}"
        )
    echo(
        f"\nETTR (ClickHouse): {summary['ettr']:.1%} over {summary['wall_s']:.0f}s wall "
        f"({summary['productive_s']:.0f}s productive)"
    )
    if summary.get("sliding_ettr_min") is not None:
        echo(f"Lowest 1-hour sliding ETTR: {summary['sliding_ettr_min']:.1%}")
    b = summary.get("baseline")
    if b:
        echo(
            f"Baseline ETTR (same scenario; timeout detection, {b['requeues']} cold requeue(s); "
            f"measured the same way): {summary['baseline_ettr']:.1%} over {b['wall_s']:.0f}s wall "
            f"({b['productive_s']:.0f}s productive)"
        )
    else:
        echo("Baseline: not run (--no-baseline)")
