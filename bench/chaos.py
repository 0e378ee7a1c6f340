"""Chaos suite: break the real servers and processes under load and count what survives.

    python bench/chaos.py [--small] [--scenario NAME ...] [--json] [--home DIR] [--keep-stack]

Starts a private stack of its own (``trainguard stack up`` with ``TRAINGUARD_HOME`` in a temporary
directory, free ports, control-plane signing on) and always stops it at the end (``trainguard stack
down``, also after a failure or Ctrl-C): nothing here touches the shared stack of the stack home.
The scenarios run one after the other, each with the real CLI processes it needs (stream workers of
one group, action services with the ``dry_run`` executor, node exporters); each is bounded in time
and count (``--small``: the sizes in brackets, for the tests).

1. ``broker_kill`` -- 3 [2] exporters (spool on) ship kernel-log lines (20 [10] a second each) and
   heartbeats; the broker is SIGKILLed 15 [6] s in, left down 20 [6] s and restarted.  Counts
   lines written vs distinct lines in ClickHouse (``FINAL``) and heartbeat sequence gaps: 0 lost.
2. ``clickhouse_outage`` -- 80 [40] training steps a second while ClickHouse is stopped 60 [15] s;
   an Xid on a fresh node every 3 [2] s.  0 steps lost or doubled (``FINAL`` vs distinct
   rank/step), every Xid during the outage detected and decided (latency before / during /
   after), every decision stored once ClickHouse is back.
3. ``worker_kill`` -- two workers share the partitions; 300 [60] Xid lines (one machine each, over
   8 jobs so both workers decide) at 20 a second; one worker is SIGKILLed a third of the way in.
   Every machine gets one decision id (redelivered decisions repeat it), ClickHouse holds one row
   per machine, and a paused action service accepts exactly one recovery per machine.
4. ``actions_kill`` -- the action service is SIGKILLed while a recovery is in evict, swap_standbys
   and restart [swap_standbys only]; restarted, each recovery completes exactly once (one
   effective evict, standby activation and restart each in the dry run's record, one final event),
   and every decision redelivered afterwards is a no-op.
5. ``fuzz_flood`` -- 10,000 [500] broken records over every topic (random bytes, truncated JSON,
   lone surrogates, 4,301-digit numbers, wrong versions, out-of-range values, the wrong event type,
   nesting too deep, non-objects, tombstones; signed with a trusted key on the signed topics):
   100% dead-lettered with a reason (dead-letter topic, and the ``dead_letters`` table for garbage
   on that topic itself), worker, action service and exporter alive, a worker decision and a
   signed decision after the flood still acted on.
6. ``forged_control`` -- 1,000 [100] forged decisions, job specs, exporter commands and worker
   control commands (unsigned, unknown key, a role's real key on a topic it may not write, expired,
   issued in the future, tampered with, replayed): 0 accepted (no recovery, no job spec replaced,
   no exporter interval or worker threshold changed), each dead-lettered at the signature check.
7. ``evict_storm`` -- a detector gone mad asks to evict every machine of 6 [4] jobs of 12 [6]
   machines; the blast-radius guard lets exactly its caps through (8 [4] per job, 32 [10] in all
   per hour) and holds the rest for an operator (a job may be held by the restart budget first:
   every eviction restarts it, 6 restarts an hour by default).  Every decision is made, no
   recovery fails, each job's queue waits behind its held recovery.
8. ``hostile_tenant`` -- a tenant links ``fr/dumps``, ``fr/requests`` and ``fr/timeout/bad`` of the
   node exporter's Flight Recorder directory to its own old files, hard-links a file as a dump, and
   leaves a 57 KB memo bomb (300x) and a 512 [256] KiB set bomb in ``fr/timeout``; then the broker
   is stopped for 20 [8] s while the node's kernel logs an Xid and the tenant floods the reporter
   socket with 20,000 [5,000] lines (one in 50 claiming to be the kernel's) into a 512 [128] KiB
   spool.  Nothing outside ``fr/`` touched, the bombs refused, the exporter alive throughout, the
   Xid delivered once the broker is back, 0 forged kernel lines delivered.
9. ``name_injection`` -- job specs, decisions, detections, log lines and steps (10 [2] rounds of 11
   names, signed where the topic is) whose job or node names hold ``/``, ``..``, blanks, a leading
   ``-`` or ``.``, or 300 characters, aimed at another job: every one dead-lettered at decode
   naming the field, nothing acted on (no recovery, the other job's spec kept), no file named
   after one anywhere, a genuine decision afterwards acted on; the Slurm executor refuses every
   name as a path and the Kubernetes job labels of names an old label merged stay apart.

Columns: ``produced``/``stored``/``lost``/``duplicated`` count each scenario's unit -- (1) log lines
plus heartbeat sequence numbers, (2) training steps, (3) machines with an Xid vs decision rows,
(4) decision records sent (redeliveries included) vs recoveries recorded, (5) fuzzed records vs
those dead-lettered, (6) forged records sent (``accepted_forged``: effects seen), (7) eviction
decisions vs recoveries recorded, (8) the node's kernel lines written during the outage vs
delivered (``accepted_forged``: the tenant's lines delivered as the kernel's), (9) records with
hostile names vs dead-lettered naming the field (``accepted_forged``: anything acted on);
``decisions e/m/a``: expected / made / acted on (accepted by a paused service in 3, completed in
4, 5, 6 and 9, succeeded evictions in 7).

Prints a table (``--json``: exactly one JSON object on stdout, ``{"scenarios": [{"name", "passed",
"produced", "stored", "lost", "duplicated", "accepted_forged", "notes", ...}]}``, the table on
stderr).  Exit code 0 when every scenario passed.  ``--home DIR`` keeps the stack home (its logs in
``DIR/chaos-logs``); ``--keep-stack`` leaves the servers running there.  While it runs, stderr
also shows the scenario on, its time so far and the scenarios done (``TRAINGUARD_PROGRESS=0``: not).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from chaos_hostile import forged_control, fuzz_flood
from chaos_procs import ChaosStack
from chaos_scenarios import (
    FULL,
    SMALL,
    Result,
    Size,
    actions_kill,
    broker_kill,
    clickhouse_outage,
    evict_storm,
    worker_kill,
)
from chaos_tenant import hostile_tenant, name_injection

from trainguard.infra.progress import Progress

Scenario = Callable[[ChaosStack, Size], Result]
SCENARIOS: dict[str, Scenario] = {
    "broker_kill": broker_kill,
    "clickhouse_outage": clickhouse_outage,
    "worker_kill": worker_kill,
    "actions_kill": actions_kill,
    "fuzz_flood": fuzz_flood,
    "forged_control": forged_control,
    "evict_storm": evict_storm,
    "hostile_tenant": hostile_tenant,
    "name_injection": name_injection,
}


def run_scenario(stack: ChaosStack, name: str, size: Size, log: TextIO, bar: Progress) -> Result:
    """One scenario; an exception is a failed result naming it (the processes it started stopped)."""
    bar.echo(f"[chaos] {name} ({size.name}) ...", file=log)
    bar.update(detail=name)
    t0 = time.monotonic()
    try:
        res = SCENARIOS[name](stack, size)
    except Exception as exc:
        res = Result(name)
        res.note(f"error: {type(exc).__name__}: {exc}"[:2000])
        bar.echo(traceback.format_exc(), file=log)
    finally:
        stack.stop_all()
    res.seconds = time.monotonic() - t0
    bar.advance()
    bar.echo(f"[chaos] {name}: {'passed' if res.passed else 'FAILED'} in {res.seconds:.0f} s", file=log)
    return res


def _cell(v: Any) -> str:
    return "-" if v is None else str(v)


def table(results: list[Result]) -> str:
    head = ["scenario", "passed", "produced", "stored", "lost", "dup", "forged acc", "decisions e/m/a", "s"]
    rows = [
        [
            r.name,
            "yes" if r.passed else "NO",
            _cell(r.produced),
            _cell(r.stored),
            _cell(r.lost),
            _cell(r.duplicated),
            _cell(r.accepted_forged),
            "/".join(_cell(v) for v in (r.decisions_expected, r.decisions_made, r.decisions_acted)),
            f"{r.seconds:.0f}",
        ]
        for r in results
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)) for row in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = [f"{r.name}: {'; '.join(r.notes)}" for r in results if r.notes]
    extras = [f"{r.name}: {json.dumps(r.extra, sort_keys=True)}" for r in results if r.extra]
    return "\n".join([*lines, "", "notes:", *notes, "", "figures:", *extras])


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--scenario", action="append", choices=list(SCENARIOS), help="run only these (repeatable)"
    )
    ap.add_argument("--small", action="store_true", help="small sizes (the integration tests)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout, the table on stderr")
    ap.add_argument("--home", type=Path, help="stack home to use and keep (default: a temporary one)")
    ap.add_argument("--keep-stack", action="store_true", help="leave the private servers running")
    args = ap.parse_args(argv)
    size = SMALL if args.small else FULL
    names = args.scenario or list(SCENARIOS)
    out = sys.stdout
    log = sys.stderr
    tmp = None
    if args.home is None:
        tmp = tempfile.TemporaryDirectory(prefix="trainguard-chaos-")
        home = Path(tmp.name)
    else:
        home = args.home
    # SIGTERM (a test timeout, a CI cancel) unwinds like Ctrl-C, so the stack goes down.
    signal.signal(signal.SIGTERM, _interrupt)
    stack = ChaosStack(home)
    results: list[Result] = []
    # The table and the JSON come after the run; meanwhile, the scenario on and its time.
    bar = Progress("chaos", total=len(names), unit="scenarios")
    with bar, bar.ticking():
        try:
            t0 = time.monotonic()
            bar.update(detail="starting the private stack")
            try:
                stack.up()
            except Exception as exc:  # every scenario fails, saying why
                bar.echo(f"[chaos] the private stack did not start: {exc}", file=log)
                for name in names:
                    results.append(Result(name, notes=[f"the private stack did not start: {exc}"[:2000]]))
                names = []
            else:
                up_s = time.monotonic() - t0
                bar.echo(f"[chaos] private stack up in {up_s:.1f} s at {home} ({stack.ports})", file=log)
            for name in names:
                results.append(run_scenario(stack, name, size, log, bar))
        except KeyboardInterrupt:
            bar.echo("[chaos] interrupted", file=log)
            return 130
        finally:
            bar.update(detail="stopping the private stack")
            try:
                if args.keep_stack:
                    stack.stop_all()
                else:
                    stack.down()
            except Exception as exc:
                bar.echo(f"[chaos] stopping the private stack failed: {exc}", file=log)
            if tmp is not None and not args.keep_stack:
                tmp.cleanup()
    text = table(results)
    if args.json:
        print(text, file=log)
        out.write(json.dumps({"scenarios": [r.to_json() for r in results]}) + "\n")
    else:
        out.write(text + "\n")
    return 0 if results and all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
