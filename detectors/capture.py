"""Gathering one stack capture of a job and judging it (ByteRobust §5 aggregation analysis).

A capture is requested from every machine of a job under one ``capture_id``; the exporters
answer with one :class:`~schemas.workload.StackDump` per process and round.  A
:class:`Capture` collects them until every rank's main process has answered for every round or
the deadline passes -- missing ranks are evidence, not a reason to wait forever -- and then
:meth:`Capture.analyze` runs the over-eviction classifier and returns the ``Detection`` to emit.
Pure: the caller supplies the clock and runs :meth:`analyze` off its event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from detectors.detections import detection_from_finding
from detectors.findings import Finding
from detectors.stacks import Frame as DumpFrame
from detectors.stacks import OverEvictionClassifier, OverEvictionConfig, ProcessDump, RankDumps, Round
from detectors.stacks import ThreadStack as DumpThread
from detectors.stacks.model import normalize_filename
from schemas.control import Detection
from schemas.enums import Action, ProcessRole, Severity, Verdict
from schemas.topology import JobTopology
from schemas.workload import StackDump


def process_dump(d: StackDump) -> ProcessDump:
    threads = tuple(
        DumpThread(
            thread_id=t.thread_id or None,
            name=t.name,
            active=t.active,
            frames=tuple(DumpFrame(f.function, normalize_filename(f.filename), f.line) for f in t.frames),
        )
        for t in d.threads
    )
    return ProcessDump(pid=d.pid, threads=threads, source=f"{d.node}/rank{d.rank}/pid{d.pid}")


def rounds_from_dumps(dumps: list[StackDump], rounds: int) -> list[Round]:
    """Per-round ``rank -> RankDumps`` (main process + children) from a capture's dumps."""
    out: list[Round] = []
    for r in range(rounds):
        mains: dict[int, ProcessDump] = {}
        children: dict[int, list[ProcessDump]] = {}
        for d in dumps:
            if d.round != r or d.rank < 0 or d.error:
                continue  # a failed dump counts as missing
            if d.role is ProcessRole.MAIN:
                mains[d.rank] = process_dump(d)
            else:
                children.setdefault(d.rank, []).append(process_dump(d))
        ranks = set(mains) | set(children)
        out.append({rk: RankDumps(rk, mains.get(rk), tuple(children.get(rk, ()))) for rk in sorted(ranks)})
    return out


@dataclass
class Capture:
    """One capture in progress for one job."""

    capture_id: str
    job: str
    topology: JobTopology
    rounds: int
    deadline_ms: int
    requested_ms: int
    decision_id: str = ""
    dumps: list[StackDump] = field(default_factory=list)

    def add(self, d: StackDump) -> None:
        self.dumps.append(d)

    def missing(self) -> dict[int, list[int]]:
        """round -> ranks whose main process has not answered (yet)."""
        got: dict[int, set[int]] = {}
        for d in self.dumps:
            if d.role is ProcessRole.MAIN and not d.error:
                got.setdefault(d.round, set()).add(d.rank)
        world = set(range(self.topology.world_size))
        return {r: sorted(world - got.get(r, set())) for r in range(self.rounds) if world - got.get(r, set())}

    def ready(self, now_ms: int) -> bool:
        return not self.missing() or now_ms >= self.deadline_ms

    def analyze(self, now_ms: int, config: OverEvictionConfig | None = None) -> Detection:
        """Run the over-eviction classifier; an eviction (or healthy) detection with the evidence."""
        topo = self.topology
        clf = OverEvictionClassifier(topo, config)
        result = clf.analyze(rounds_from_dumps(self.dumps, self.rounds), mode="auto")
        out = result.to_dict()
        machines = [topo.machine_name(m) for m in result.evict_machines]
        out["evict"]["machine_names"] = machines
        out["capture_id"] = self.capture_id
        out["missing_ranks"] = {str(r): v for r, v in self.missing().items()}
        out["dumps"] = len(self.dumps)
        evict = result.verdict is not Verdict.HEALTHY and bool(result.evict_ranks)
        category = {Verdict.HANG: "job_hang", Verdict.FAIL_SLOW: "fail_slow"}.get(result.verdict, "healthy")
        finding = Finding(
            kind="over_eviction",
            category=category,
            severity=Severity.ERROR if evict else Severity.INFO,
            action=Action.EVICT if evict else Action.NONE,
            job=self.job,
            ranks=tuple(result.suspect_ranks),
            evidence=out,
        )
        msg = (
            f"{result.verdict.value}: evict {result.evict_kind} group {list(result.evict_ranks)} "
            f"on {', '.join(machines)} (suspects {list(result.suspect_ranks)})"
            if evict
            else f"{result.verdict.value}: no group to evict"
        )
        return detection_from_finding(
            finding,
            job=self.job,
            source_ts_ms=self.requested_ms,
            now_ms=now_ms,
            source_key=self.capture_id,
            message=msg,
        )
