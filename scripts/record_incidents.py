"""Record one replayable incident stream per fault kind from a finished `trainguard demo` run.

For each incident of the demo's summary (``--summary``, the JSON that ``trainguard demo`` ends
with: ``job`` and ``incidents: [{fault, machine, injected_at, recovered_s, action, ...}]``) this
reads the window ``[injected_at - 10 s, injected_at + (recovered_s or 40) + 5 s]`` of the
detectors' input topics (GPU/NIC/host telemetry, log lines, steps, exits, stack dumps, job
specs, commands) from the real broker with :func:`trainguard.infra.replay.record`, keeps the records of
that job and of its machines (the machines and standbys of any of its specs), and writes
``OUT/<fault>.jsonl`` in the :mod:`trainguard.infra.replay` format.  Besides:

* the job's latest spec from *before* the window is put first (the jobs topic is compacted
  knowledge: the worker knows the topology from the job's start); its record time is set to the
  window start so a replay does not wait for it, the event itself is unchanged;
* of the decisions topic only the operator's code update of the ``user-error`` fault is kept
  (an input of the action service).  The stream worker's own decisions made after the
  injection from events of the window (event time up to the window's end, decided up to 30 s
  later: a lagging worker decides late) are what the real run decided, and go into
  ``OUT/expected.yaml`` (one row per fault, with what the demo reported) instead;
* the worker's decisions of the ``--lookback-s`` (90 s) before the window go into
  ``OUT/<fault>.prior.jsonl``: the worker's state when the window opens (de-duplication of
  repeats, capture cooldown), which an offline replay starts from;
* GPU sample batches further than ``--gpu-keep-s`` (3 s) from the injection are dropped when a
  recording would otherwise exceed ``--max-bytes`` (no GPU rule fires on this CPU-only cluster;
  the batches feed only the informational anomaly scores);
* ``OUT/worker.yaml`` is the demo worker's config section (thresholds the fixtures were made
  with; the replay tests run the detectors with them).

Usage: ``.venv/bin/python scripts/record_incidents.py --summary /tmp/s2.json --out tests/fixtures/incidents``
(the demo's broker must still hold the run: topics keep 7 days).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainguard.infra.config import load_settings  # noqa: E402
from trainguard.infra.replay import record  # noqa: E402
from trainguard.schemas.base import Event  # noqa: E402
from trainguard.schemas.codec import DecodeError, decode  # noqa: E402
from trainguard.schemas.control import Command, Decision, JobSpec  # noqa: E402
from trainguard.schemas.topics import (  # noqa: E402
    COMMANDS,
    DECISIONS,
    EXITS,
    FLIGHT_RECORDER,
    GPU,
    HOST,
    JOBS,
    LOGS,
    NIC,
    STACKS,
    STEPS,
)
from trainguard.schemas.workload import StackDump  # noqa: E402

INPUT_TOPICS = [GPU, HOST, NIC, LOGS, STEPS, EXITS, STACKS, FLIGHT_RECORDER, JOBS, COMMANDS, DECISIONS]
#: worker config keys that are about the process, not the detectors.
_PROCESS_KEYS = ("app_id", "web_port", "web_host", "auto_offset_reset")


def window_ms(inc: dict[str, Any]) -> tuple[int, int]:
    t = float(inc["injected_at"])
    after = inc.get("recovered_s")
    return int((t - 10) * 1000), int((t + (after if after is not None else 40) + 5) * 1000)


def read_window(kafka: Any, topics: list[str], since: int, until: int) -> list[dict[str, Any]]:
    buf = io.StringIO()
    record(kafka, topics, since, buf, until_ms=until)
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


def event_of(rec: dict[str, Any]) -> Event | None:
    value = rec.get("value")
    if not isinstance(value, str):
        return None  # garbage recorded as base64: not this job's, as far as anyone can tell
    try:
        return decode(value.encode())
    except DecodeError:
        return None


def job_specs(kafka: Any, job: str, until: int) -> list[tuple[dict[str, Any], JobSpec]]:
    out = []
    for rec in read_window(kafka, [JOBS.name], 0, until):
        ev = event_of(rec)
        if isinstance(ev, JobSpec) and ev.job == job:
            out.append((rec, ev))
    return sorted(out, key=lambda p: p[1].ts_ms)


def is_code_update(d: Decision) -> bool:
    return isinstance(d.evidence, dict) and "code_update" in d.evidence


def keep(ev: Event, job: str, nodes: set[str]) -> bool:
    """A record of ``job`` or of one of its machines (telemetry not tagged with a job)."""
    if isinstance(ev, Decision):
        return ev.job == job and is_code_update(ev)
    ev_job = getattr(ev, "job", "")
    if isinstance(ev, JobSpec | StackDump | Command):
        return bool(ev_job == job)
    return ev_job == job or (not ev_job and getattr(ev, "node", "") in nodes)


def source_ms(d: Decision) -> int:
    """Event time of what the decision was made from (its detection's trigger)."""
    det = d.evidence.get("detection") if isinstance(d.evidence, dict) else None
    return int((det or {}).get("source_ts_ms") or d.ts_ms)


def decision_row(d: Decision, inj_ms: int) -> dict[str, Any]:
    det = d.evidence.get("detection", {}) if isinstance(d.evidence, dict) else {}
    return {
        "at_s": round((d.ts_ms - inj_ms) / 1000, 2),
        "source_s": round((source_ms(d) - inj_ms) / 1000, 2),
        "action": d.action.value,
        "machines": list(d.targets.machines),
        "group_kind": d.targets.group_kind,
        "detection": str(det.get("kind", "")),
    }


def record_incident(
    kafka: Any, job: str, inc: dict[str, Any], out: Path, opts: argparse.Namespace
) -> dict[str, Any]:
    since, until = window_ms(inc)
    inj_ms = int(float(inc["injected_at"]) * 1000)
    specs = job_specs(kafka, job, until)
    nodes = {n for _, s in specs for n in (*s.topology.machines, *s.standbys)}
    before = [(rec, s) for rec, s in specs if rec["ts_ms"] < since]
    lines: list[dict[str, Any]] = []
    if before:
        first = dict(before[-1][0])
        first["ts_ms"] = since
        lines.append(first)
    for rec in read_window(kafka, [t.name for t in INPUT_TOPICS], since, until):
        ev = event_of(rec)
        if ev is not None and keep(ev, job, nodes):
            lines.append(rec)
    # The worker's own decisions: before the window (its state at the start), and the ones made
    # from the window's events, however late (lag): event time in the window, decided after the
    # injection.
    prior: list[dict[str, Any]] = []
    decisions: list[dict[str, Any]] = []
    lookback = int(opts.lookback_s * 1000)
    for rec in read_window(kafka, [DECISIONS.name], since - lookback, until + 30_000):
        ev = event_of(rec)
        if not isinstance(ev, Decision) or ev.job != job or is_code_update(ev):
            continue
        if rec["ts_ms"] < since:
            prior.append(rec)
        elif ev.ts_ms >= inj_ms and source_ms(ev) <= until:
            decisions.append(decision_row(ev, inj_ms))

    def size(recs: list[dict[str, Any]]) -> int:
        return sum(len(json.dumps(r, separators=(",", ":"))) + 1 for r in recs)

    trimmed = False
    if size(lines) > opts.max_bytes:
        keep_ms = opts.gpu_keep_s * 1000
        lines = [r for r in lines if r["topic"] != GPU.name or abs(int(r["ts_ms"]) - inj_ms) <= keep_ms]
        trimmed = True
    fault = inc["fault"]
    for name, recs in ((f"{fault}.jsonl", lines), (f"{fault}.prior.jsonl", prior)):
        with open(out / name, "w", encoding="utf-8") as fh:
            for r in recs:
                fh.write(json.dumps(r, separators=(",", ":")) + "\n")
    return {
        "fault": fault,
        "machine": inc["machine"],
        "recording": f"{fault}.jsonl",
        "prior_decisions": f"{fault}.prior.jsonl",
        "injected_at_ms": inj_ms,
        "window_ms": [since, until],
        "records": len(lines),
        "gpu_trimmed": trimmed,
        "demo": {
            k: inc.get(k)
            for k in ("action", "recovered", "detected_s", "localised_s", "decided_s", "recovered_s")
        },
        "decisions": decisions,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--summary", type=Path, required=True, help="the demo's summary JSON")
    p.add_argument("--out", type=Path, required=True, help="fixture folder")
    p.add_argument("--run-dir", type=Path, default=None, help="the demo run's folder (for worker.yaml)")
    p.add_argument("--max-bytes", type=int, default=1_400_000)
    p.add_argument("--gpu-keep-s", type=float, default=3.0)
    p.add_argument(
        "--lookback-s", type=float, default=90.0, help="worker decisions this long before a window: its state"
    )
    args = p.parse_args(argv)
    summary = json.loads(args.summary.read_text())
    job = summary["job"]
    settings = load_settings()
    run_dir = args.run_dir or settings.stack.home_path / "demo" / job.removeprefix("demo-")
    kafka = settings.kafka
    args.out.mkdir(parents=True, exist_ok=True)
    worker = dict(yaml.safe_load((run_dir / "trainguard.yaml").read_text())["worker"])
    for key in _PROCESS_KEYS:
        worker.pop(key, None)
    (args.out / "worker.yaml").write_text(yaml.safe_dump(worker, sort_keys=True))
    rows = []
    for inc in summary["incidents"]:
        row = record_incident(kafka, job, inc, args.out, args)
        size = (args.out / row["recording"]).stat().st_size
        print(
            f"{row['fault']:<16} {row['records']:>6} records {size / 1e6:6.2f} MB  "
            f"decisions {[(d['action'], d['machines']) for d in row['decisions']]}"
        )
        rows.append(row)
    header = f"# What the demo run {job} decided per incident (scripts/record_incidents.py).\n"
    (args.out / "expected.yaml").write_text(header + yaml.safe_dump(rows, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
