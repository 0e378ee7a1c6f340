"""Where the machine's CPU goes while something runs (e.g. the demo): CPU seconds per process kind.

    .venv/bin/python bench/cpu_by_process.py --seconds 600 [--interval 2] [--json]
    .venv/bin/python bench/cpu_by_process.py -- .venv/bin/trainguard demo      # for the command's run

Samples every process's CPU time (``/proc/<pid>/stat`` utime + stime) every ``--interval``
seconds and attributes the growth to a kind from its command line (Kafka, ClickHouse, stream
worker, action service, node exporters, training ranks, warm pools and zygotes, the baseline job,
the demo driver, other).  A process that lives shorter than one interval is missed, so the
total is a lower bound; the share of the machine is the total over ``cores x wall``.  Without a
command, stderr counts the seconds down (``TRAINGUARD_PROGRESS=0``: not); with one, the command's
own output is the progress.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from trainguard.infra.progress import Progress, quiet

#: (kind, substrings of the command line, any of which marks it); the first match wins.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kafka", ("kafka.Kafka", "kafka-server", "org.apache.kafka")),
    ("clickhouse", ("clickhouse",)),
    ("baseline job", ("baseline-cluster",)),
    # Faust retitles its worker process ("[Faust:Worker] -init- <app id> ...").
    ("stream worker", ("[Faust:Worker]", "trainguard worker", "trainguard.__main__ worker")),
    ("action service", ("trainguard actions", "actions run")),
    ("diagnostics", ("diagnostics",)),
    ("node exporters", ("demo-exporter", "trainguard exporter")),
    ("warm pools / zygotes", ("trainguard_demo.zygote", "trainguard_demo.standby")),
    ("training ranks", ("trainguard_demo.trainer", "trainguard_demo.launcher")),
    ("demo driver", ("trainguard demo", "demo_runs")),
    ("py-spy", ("py-spy",)),
)
TICK = os.sysconf("SC_CLK_TCK")


def kind_of(cmdline: str) -> str:
    """The kind a process's command line belongs to (``other`` when none matches).

    >>> kind_of("java -cp x kafka.Kafka server.properties")
    'kafka'
    >>> kind_of("python -m trainguard_demo.trainer --cluster /x/cluster --machine m0")
    'training ranks'
    >>> kind_of("bash")
    'other'
    """
    for kind, marks in KINDS:
        if any(m in cmdline for m in marks):
            return kind
    return "other"


def sample(root: Path = Path("/proc")) -> dict[int, tuple[str, float]]:
    """pid -> (kind, CPU seconds so far) of every process readable now."""
    out: dict[int, tuple[str, float]] = {}
    for entry in root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        kind = kind_of(cmd)
        if kind == "other":  # broken down by the process's name: what it is matters most here
            kind = f"other: {stat[stat.index('(') + 1 : stat.rindex(')')] or '?'}"
        out[int(entry.name)] = (kind, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def measure(
    seconds: float, interval: float, command: list[str], progress: Progress | None = None
) -> dict[str, object]:
    bar = progress or quiet()
    proc = subprocess.Popen(command) if command else None
    first = sample()
    seen = dict(first)
    start = time.monotonic()
    while True:
        time.sleep(interval)
        for pid, (kind, cpu) in sample().items():
            if pid in seen and kind.startswith("other") and not seen[pid][0].startswith("other"):
                # An exiting process (a zombie) has an empty command line: it keeps the kind it
                # had alive.  Reading it as "other" put every killed rank's CPU there (2,915 of
                # 4,623 CPU s of three demo runs at 45863d1).
                kind = seen[pid][0]
            if pid not in seen or cpu >= seen[pid][1]:
                seen[pid] = (kind, cpu)
        bar.update(int(time.monotonic() - start), detail=f"{len(seen)} processes seen")
        done = proc.poll() is not None if proc else time.monotonic() - start >= seconds
        if done:
            break
    wall = time.monotonic() - start
    by_kind: dict[str, float] = {}
    for pid, (kind, cpu) in seen.items():
        grown = cpu - first[pid][1] if pid in first else cpu
        if pid != os.getpid() and grown > 0:
            by_kind[kind] = by_kind.get(kind, 0.0) + grown
    total = sum(by_kind.values())
    cores = os.cpu_count() or 1
    return {
        "wall_s": round(wall, 1),
        "cores": cores,
        "cpu_s": round(total, 1),
        "machine_share": round(total / (cores * wall), 3) if wall > 0 else None,
        "by_kind": {k: round(v, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "exit_code": proc.returncode if proc else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long, without a command")
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("command", nargs="*", help="a command to run and measure (after --)")
    args = parser.parse_args()
    # This process's CPU is left out of the measure.  With a command, none: its output shares the
    # terminal and a rewritten line would garble it.
    with Progress(
        "cpu by process", total=args.seconds, unit="s", rate=False, summary=False, enabled=not args.command
    ) as bar:
        result = measure(args.seconds, args.interval, args.command, bar)
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{result['cpu_s']} CPU s over {result['wall_s']} s wall on {result['cores']} cores "
        f"({float(result['machine_share'] or 0):.0%} of the machine)"
    )
    by_kind = result["by_kind"]
    assert isinstance(by_kind, dict)
    for kind, cpu in by_kind.items():
        print(f"  {kind:<22}{cpu:>8.1f} s  {cpu / float(result['cpu_s'] or 1):6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
