"""Stop-time diagnostics on local "machines": run each test once per machine (or machine pair)
through the test server, compare the answers, and give one verdict per (machine, test).

* alignment: with no strict majority digest nobody can be trusted, so every machine is flagged;
* connectivity: each machine with its ring neighbour; a machine is suspect when *all* its pairs
  fail; if every pair fails, all machines are flagged (a fabric-wide problem is not one machine's
  fault -- the blast-radius guard then holds it).

Faults are injectable (:class:`LocalFaults`) for tests and the demo.
"""

from __future__ import annotations

import collections
import socket
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from trainguard.actions.executors.base import DiagnosticResult
from trainguard_demo.diagnostics.server import run_tests

#: the tests :func:`run_local` knows, in the order it runs them.
LOCAL_TESTS = ("alignment", "connectivity")


@dataclass(frozen=True)
class LocalFaults:
    """Injected faults for local runs: which machines misbehave, and how."""

    perturb: frozenset[str] = frozenset()  # wrong alignment arithmetic
    corrupt: frozenset[str] = frozenset()  # corrupts all-gather payloads
    absent: frozenset[str] = frozenset()  # never joins the collective (unreachable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_alignment(
    machines: list[str], faults: LocalFaults, timeout_s: float = 60.0
) -> list[DiagnosticResult]:
    t0 = time.monotonic()
    found = run_tests([("alignment", {"perturb": m in faults.perturb}) for m in machines], timeout_s)
    answers = dict(zip(machines, found, strict=True))
    ms = (time.monotonic() - t0) * 1000
    digests: dict[str, str] = {m: str(a["digest"]) for m, a in answers.items() if a.get("digest")}
    common, count = collections.Counter(digests.values()).most_common(1)[0] if digests else ("", 0)
    majority = count * 2 > len(machines)
    out = []
    for m in machines:
        d = digests.get(m)
        if d is None:
            out.append(DiagnosticResult(m, "alignment", False, answers[m].get("detail", "no digest"), ms))
        elif not majority:
            out.append(DiagnosticResult(m, "alignment", False, f"no majority digest ({d[:12]})", ms))
        else:
            detail = "bit-identical" if d == common else f"digest {d[:12]} != majority {common[:12]}"
            out.append(DiagnosticResult(m, "alignment", d == common, detail, ms))
    return out


def ring_pairs(n: int) -> list[tuple[int, int]]:
    """Each machine with its ring neighbour (one pair for two machines)."""
    if n < 2:
        return []
    return [(0, 1)] if n == 2 else [(i, (i + 1) % n) for i in range(n)]


def run_connectivity(
    machines: list[str], faults: LocalFaults, timeout_s: float = 20.0
) -> list[DiagnosticResult]:
    t0 = time.monotonic()
    pairs = ring_pairs(len(machines))
    requests: list[tuple[str, dict[str, Any]]] = []
    slots: list[list[int | None]] = []  # per pair and side: the index of its request, None if absent
    for a, b in pairs:
        port = free_port()
        slots.append([])
        for rank, idx in enumerate((a, b)):
            m = machines[idx]
            if m in faults.absent:
                slots[-1].append(None)
                continue
            slots[-1].append(len(requests))
            args = {"rank": rank, "world": 2, "port": port, "timeout_s": timeout_s}
            requests.append(("connectivity", {**args, "corrupt": m in faults.corrupt}))
    found = run_tests(requests, timeout_s + 30)
    passed: dict[tuple[int, int], bool] = {}
    details: dict[int, list[str]] = collections.defaultdict(list)
    for (a, b), sides in zip(pairs, slots, strict=True):
        answers = [found[s] if s is not None else {"ok": False, "detail": "absent"} for s in sides]
        passed[(a, b)] = all(x.get("ok") for x in answers)
        for idx, ans in zip((a, b), answers, strict=True):
            details[idx].append(f"with {machines[b if idx == a else a]}: {ans.get('detail')}")
    ms = (time.monotonic() - t0) * 1000
    everything_failed = bool(passed) and not any(passed.values())
    out = []
    for i, m in enumerate(machines):
        mine = [ok for pair, ok in passed.items() if i in pair]
        ok = not everything_failed and (not mine or any(mine))
        out.append(DiagnosticResult(m, "connectivity", ok, "; ".join(details[i]) or "no peer", ms))
    return out


def run_local(
    machines: list[str], tests: Iterable[str], faults: LocalFaults | None = None, timeout_s: float = 30.0
) -> list[DiagnosticResult]:
    """Both stop-time tests for local machines (subprocesses); one result per (machine, test).

    The tests run at the same time (the job is stopped while they run: every second counts),
    their results in the order of ``tests``."""
    faults = faults or LocalFaults()
    runners = {
        "alignment": lambda: run_alignment(machines, faults, timeout_s * 2),
        "connectivity": lambda: run_connectivity(machines, faults, timeout_s),
    }
    wanted = list(tests)
    for test in wanted:
        if test not in runners:
            raise ValueError(f"unknown test {test!r}; known: {list(LOCAL_TESTS)}")
    with ThreadPoolExecutor(max_workers=max(1, len(wanted)), thread_name_prefix="diag") as pool:
        futures = [pool.submit(runners[t]) for t in wanted]
        return [r for f in futures for r in f.result()]
