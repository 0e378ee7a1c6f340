"""Gathering one stack capture of a job and judging it (ByteRobust §5 aggregation analysis).

A capture is requested from every machine of a job under one ``capture_id``; the exporters
answer with one :class:`~trainguard.schemas.workload.StackDump` per process and round.  A
:class:`Capture` collects them until every rank's main process has answered for every round or
the deadline passes -- missing ranks are evidence, not a reason to wait forever -- and then
:meth:`Capture.analyze` runs the over-eviction classifier and returns the ``Detection`` to emit.
Pure: the caller supplies the clock and runs :meth:`analyze` off its event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trainguard.detectors.detections import detection_from_finding
from trainguard.detectors.eviction import MACHINE, preference_order
from trainguard.detectors.findings import Finding
from trainguard.detectors.flight_recorder.analysis import (
    FlightRecorderConfig,
    FlightRecorderResult,
    analyze_dumps,
)
from trainguard.detectors.flight_recorder.combine import combine
from trainguard.detectors.flight_recorder.events import event_to_dump
from trainguard.detectors.stacks import Frame as DumpFrame
from trainguard.detectors.stacks import (
    OverEvictionClassifier,
    OverEvictionConfig,
    ProcessDump,
    RankDumps,
    Round,
)
from trainguard.detectors.stacks import ThreadStack as DumpThread
from trainguard.detectors.stacks.model import normalize_filename
from trainguard.schemas.control import Command, CommandKind, Decision, Detection, stable_id
from trainguard.schemas.enums import Action, ProcessRole, Severity, Verdict
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.typecheck import bounds
from trainguard.schemas.workload import FlightRecorderDump, StackDump

#: detection categories that are fail-slow suspicions: several rounds of dumps, not one.
FAIL_SLOW_CATEGORIES = ("fail_slow", "straggler", "mfu_decline")
#: detection kinds of a stalled job: a capture for one is moot if the job steps after it.
HANG_KINDS = ("hang", "hang_suspect")
#: a capture handed over for analysis holds its job's next capture back at most this long (an
#: analysis takes about a second even at 9,600 ranks; a lost hand-back must not block the job).
ANALYSIS_GRACE_MS = 60_000
#: a hang's capture counts a collective as stuck in the Flight Recorder once it waited this share
#: of the stall threshold (or ``min_stuck_s``, if less): the stall already says the job has not
#: stepped for that long, and a fast job's threshold (2 s in the demo) is under ``min_stuck_s``.
FR_STUCK_SHARE = 0.4
#: the error an exporter answers for a rank whose reporter did not turn the Flight Recorder on:
#: the job has no recorder there, so the recorder is no witness for this capture.
FR_NOT_ENABLED = "not enabled"


@dataclass(frozen=True)
class AggregationConfig:
    """ByteRobust §5: stack capture on hang / fail-slow suspicion."""

    #: give up waiting for missing ranks' dumps after this long; missing ranks are evidence.
    deadline_s: float = field(default=20.0, metadata=bounds(0.5, 3600))
    #: fail-slow: rounds of dumps and the interval between them (paper: 5 rounds, 10 s).
    fail_slow_rounds: int = field(default=5, metadata=bounds(1, 100))
    fail_slow_interval_s: float = field(default=10.0, metadata=bounds(0.1, 600))
    #: a new capture for the same job waits at least this long after the previous one.
    cooldown_s: float = field(default=60.0, metadata=bounds(0, 86_400))
    #: a hang's capture is judged once the worker has read the steps up to the moment it is
    #: judged for (a lagging worker would take steps it has not read yet for a hang), but no
    #: longer than this after that moment.
    max_judge_lag_s: float = field(default=30.0, metadata=bounds(0, 3600))
    #: a hang refused a capture (the cooldown, another capture open) is asked again when one may
    #: start, if the job has taken no step since; forgotten after this long.
    defer_hang_s: float = field(default=180.0, metadata=bounds(0, 86_400))
    #: a fail-slow suspicion refused a capture (a hang's capture open) is asked again when one
    #: may start; forgotten after this long (the suspicion is reported once per decline).
    defer_slow_s: float = field(default=120.0, metadata=bounds(0, 86_400))
    #: the over-eviction classifier's thresholds (the fail-slow vote's significance, how many
    #: more rounds a close vote takes, the eviction preference).
    over_eviction: OverEvictionConfig = field(default_factory=OverEvictionConfig)
    #: a hang's capture also asks every rank for its Flight Recorder dump and combines its verdict
    #: with the stacks' (a fail-slow capture does not: every collective completes on a slow job).
    flight_recorder: bool = True
    #: the Flight Recorder analysis's thresholds.
    flight_recorder_analysis: FlightRecorderConfig = field(default_factory=FlightRecorderConfig)


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
    #: a hang's capture: the time of the last step seen when the stall was reported.  A step
    #: taken after the capture was requested means the job was not hung: nothing is evicted.
    stalled_since_ms: int | None = None
    #: a hang *suspicion*'s capture (asked for before the stall reached the hang threshold) is
    #: judged no earlier than when it would have become a hang.
    not_before_ms: int = 0
    #: fail-slow: the ranks the straggler detection that asked for the capture named.
    hint: tuple[int, ...] = ()
    #: fail-slow: the rounds asked for before the last "more rounds" (0: none asked yet).
    extended_from: int = 0
    #: whether the ranks were asked for their Flight Recorder dumps, and their answers by rank.
    flight_recorder: bool = False
    fr: dict[int, FlightRecorderDump] = field(default_factory=dict)
    #: a hang's capture: the stall threshold of the detection that asked for it (seconds).
    stall_threshold_s: float | None = None
    #: started without the cooldown, to look again after a capture the Flight Recorder judged
    #: slow, not hung (its own such verdict does not skip the cooldown again: no capture storm).
    recheck: bool = False

    def add(self, d: StackDump) -> None:
        self.dumps.append(d)

    def add_fr(self, d: FlightRecorderDump) -> None:
        if 0 <= d.rank < self.topology.world_size:
            self.fr[d.rank] = d

    def flight_recorder_result(
        self, config: FlightRecorderConfig | None = None
    ) -> tuple[FlightRecorderResult | None, dict[str, object]]:
        """The recorder's verdict on this capture (None: no witness) and what the evidence says of it."""
        if not self.fr:
            note = "asked, no answer" if self.flight_recorder else "not asked"
            return None, {"used": False, "reason": f"no Flight Recorder dumps ({note})"}
        errors = {r: d.error for r, d in sorted(self.fr.items()) if d.error}
        off = sorted(r for r, e in errors.items() if FR_NOT_ENABLED in e)
        info: dict[str, object] = {"answers": len(self.fr), "errors": {str(r): e for r, e in errors.items()}}
        if off:
            # Ranks without a recorder would count as "undumped" suspects: no witness at all.
            return None, {**info, "used": False, "reason": f"the Flight Recorder is off on ranks {off}"}
        dumps = {r: event_to_dump(d) for r, d in self.fr.items() if not d.error}
        if not dumps:
            return None, {**info, "used": False, "reason": "no rank could dump its Flight Recorder"}
        dump_ns = {r: d.ts_ms * 1_000_000 for r, d in self.fr.items() if not d.error}
        config = config or FlightRecorderConfig()
        if self.stall_threshold_s is not None:
            stuck = min(config.min_stuck_s, FR_STUCK_SHARE * self.stall_threshold_s)
            config = replace(config, min_stuck_s=stuck)
            info["min_stuck_s"] = round(stuck, 3)
        try:
            result = analyze_dumps(dumps, self.topology, dump_ns, config)
        except ValueError as exc:
            return None, {**info, "used": False, "reason": f"Flight Recorder analysis failed: {exc}"}
        return result, {**info, "used": True, **result.to_dict()}

    def missing(self, since: int = 0) -> dict[int, list[int]]:
        """round -> ranks whose main process has not answered (yet), for the rounds from ``since``."""
        got: dict[int, set[int]] = {}
        for d in self.dumps:
            if d.role is ProcessRole.MAIN and not d.error:
                got.setdefault(d.round, set()).add(d.rank)
        world = set(range(self.topology.world_size))
        return {
            r: sorted(world - got.get(r, set()))
            for r in range(since, self.rounds)
            if world - got.get(r, set())
        }

    def fr_missing(self) -> list[int]:
        """Ranks whose Flight Recorder has not answered (none when it was not asked)."""
        if not self.flight_recorder:
            return []
        return [r for r in range(self.topology.world_size) if r not in self.fr]

    def ready(self, now_ms: int) -> bool:
        """Complete or past its deadline (and not before ``not_before_ms``).  Complete counts the
        rounds asked for last (from ``extended_from``): an earlier round's missing answers were
        given up on when it was judged, and waiting for them again would hold every later batch
        to its deadline."""
        answered = not self.missing(self.extended_from) and not self.fr_missing()
        return now_ms >= self.not_before_ms and (answered or now_ms >= self.deadline_ms)

    def answered(self) -> list[int]:
        """The rounds asked for that have at least one main-process dump, in order: a round nobody
        answered (its dumps later than the deadline, exporters gone, a replay without it) is no
        evidence either way, and one lost in the middle does not hide the rounds after it."""
        got = {d.round for d in self.dumps if d.role is ProcessRole.MAIN and not d.error and d.rank >= 0}
        return [r for r in range(self.rounds) if r in got]

    def extra_rounds(self, more: int, max_rounds: int) -> int:
        """How many of the ``more`` rounds a close fail-slow vote asks for this capture follows (0:
        the verdict stands as it is).

        None for a one-round capture, or when no round of the last batch asked for (from
        ``extended_from``) was answered: the exporters did not answer it, and more rounds would
        not come either.  A batch whose last rounds came after the deadline (dumps slowed by a
        loaded machine) did answer: its lost rounds are left out of the vote, and the capture goes
        on.  In all, at most ``max_rounds`` rounds are asked for (the classifier's
        ``fail_slow_max_rounds``): the looks at the vote stay the ones its significance is spent
        over (:meth:`~trainguard.detectors.stacks.OverEvictionClassifier._alpha_per_test`)."""
        if more <= 0 or self.rounds <= 1:
            return 0
        if not any(r >= self.extended_from for r in self.answered()):
            return 0
        return max(0, min(more, max_rounds - self.rounds))

    def round_pace_s(self) -> float | None:
        """Seconds from one round to the next on the slowest machine, over the rounds of the last
        batch (from ``extended_from``) each machine answered: the interval between rounds plus
        the time its dumps took (py-spy on a loaded machine: seconds, not tens of ms).  From the
        dumps' own timestamps, each machine's against its own clock.  None: fewer than two
        rounds of the batch answered on every machine that answered."""
        ends: dict[str, dict[int, int]] = {}
        for d in self.dumps:
            if d.role is ProcessRole.MAIN and not d.error and d.rank >= 0 and d.round >= self.extended_from:
                node = ends.setdefault(d.node, {})
                node[d.round] = max(node.get(d.round, d.ts_ms), d.ts_ms)
        paces = []
        for by_round in ends.values():
            first, last = min(by_round, default=0), max(by_round, default=0)
            if last > first:
                paces.append((by_round[last] - by_round[first]) / 1000 / (last - first))
        return max(paces) if paces else None

    def analyze(
        self,
        now_ms: int,
        config: OverEvictionConfig | None = None,
        fr_config: FlightRecorderConfig | None = None,
    ) -> Detection:
        """Run the over-eviction classifier; an eviction (a hang with nothing to evict: a restart;
        else healthy) detection with the evidence.

        A fail-slow vote that is close says so in ``evidence.evidence.more_rounds``: the caller
        (:meth:`Captures.extend`) captures those rounds and judges again, or emits the healthy
        verdict as it is when :meth:`extra_rounds` follows none of them."""
        topo = self.topology
        clf = OverEvictionClassifier(topo, config)
        rounds = rounds_from_dumps(self.dumps, self.rounds)
        if self.rounds > 1:  # fail-slow: leave out the rounds nobody answered
            rounds = [rounds[r] for r in self.answered()] or rounds[:1]
        stacks = clf.analyze(rounds, mode="auto", hint=self.hint)
        fr, fr_info = self.flight_recorder_result(fr_config)
        preference = preference_order(clf.config.evict_preference)
        alone = (fr_config or FlightRecorderConfig()).min_stuck_s
        share = clf.config.max_group_share
        result = combine(stacks, fr, topo, preference, alone_min_stuck_s=alone, max_group_share=share)
        out = stacks.to_dict()
        out["verdict"] = result.verdict.value
        out["suspect_ranks"] = list(result.suspect_ranks)
        machines = [topo.machine_name(m) for m in result.evict_machines]
        out["evict"] = {
            "kind": result.evict_kind,
            "ranks": list(result.evict_ranks),
            "machines": list(result.evict_machines),
            "machine_names": machines,
            "why": result.evict_why,
            "not_evicted": result.not_evicted.to_dict() if result.not_evicted else None,
        }
        out["decided_by"] = result.decided_by
        out["reason"] = result.reason
        own = stacks.to_dict()
        out["stacks"] = {
            "verdict": own["verdict"],
            "suspect_ranks": own["suspect_ranks"],
            "evict": own["evict"],
        }
        out["flight_recorder"] = fr_info
        out["capture_id"] = self.capture_id
        out["missing_ranks"] = {str(r): v for r, v in self.missing().items()}
        out["dumps"] = len(self.dumps)
        if self.stalled_since_ms is not None:
            # A hang's capture: a healthy verdict on it ends the stall's incident, as a moot one
            # does, so the hang reported after it is decided (and captured) anew.
            out["stalled_since_ms"] = self.stalled_since_ms
        evict = result.verdict is not Verdict.HEALTHY and bool(result.evict_ranks)
        # A hang whose suspects no eviction fits (they are on every machine of the job): restart in
        # place -- replacing every machine is no localisation, and doing nothing leaves it hung.
        # A fail-slow job still trains: it is left running, the verdict on record.
        restart = result.verdict is Verdict.HANG and not evict
        action = Action.EVICT if evict else Action.RESTART if restart else Action.NONE
        category = {Verdict.HANG: "job_hang", Verdict.FAIL_SLOW: "fail_slow"}.get(result.verdict, "healthy")
        more = stacks.evidence.more_rounds if result.decided_by == "stacks" else 0
        out["evidence"]["more_rounds"] = more
        finding = Finding(
            kind="over_eviction",
            category=category,
            severity=Severity.ERROR if evict or restart else Severity.INFO,
            action=action,
            job=self.job,
            ranks=tuple(result.suspect_ranks),
            evidence=out,
        )
        witness = {"both": "stacks + Flight Recorder", "union": "stacks + Flight Recorder, both groups"}.get(
            result.decided_by, result.decided_by.replace("_", " ")
        )
        if evict:
            what = (
                "machine(s)"
                if result.evict_kind == MACHINE
                else f"{result.evict_kind} group {list(result.evict_ranks)} on"
            )
            msg = f"{result.verdict.value}: evict {what} {', '.join(machines)} "
            msg += f"(suspects {list(result.suspect_ranks)}; {witness})"
            if result.evict_why:
                msg += f"; {result.evict_why}"
        elif restart:
            msg = f"{result.verdict.value}: restart in place, no machine to evict "
            msg += f"(suspects {list(result.suspect_ranks)}; {witness}): {result.evict_why or result.reason}"
        else:
            msg = f"{result.verdict.value}: no group to evict"
            follow = self.extra_rounds(more, clf.config.fail_slow_max_rounds)
            if follow:
                msg += f" yet ({follow} more rounds asked for)"
            elif more:
                # Said, so a close vote left as it is can be told from a healthy one in the logs.
                msg += f" (a close vote over {len(rounds)} rounds: {self._why_no_more()})"
            msg += f"; {result.evict_why}" if result.evict_why else ""
        return detection_from_finding(
            finding,
            job=self.job,
            source_ts_ms=self.requested_ms,
            now_ms=now_ms,
            source_key=self.capture_id,
            message=msg,
        )

    def _why_no_more(self) -> str:
        """Why :meth:`extra_rounds` follows none of a close vote's more rounds."""
        if self.rounds <= 1:
            return "a one-round capture takes no more rounds"
        if not any(r >= self.extended_from for r in self.answered()):
            return f"no round of {self.extended_from}-{self.rounds - 1} was answered, no more are asked"
        return f"{self.rounds} rounds asked for, the most one capture takes"

    def moot(self, last_step_ms: int, now_ms: int) -> Detection:
        """The verdict on a hang's capture when the job took a step (at ``last_step_ms``) after
        the capture was requested: healthy, nothing evicted -- the stacks of a job that is
        training show ranks wherever they happen to be, and the classifier would pick a
        "suspect" among them (a false eviction of two healthy machines, seen in a demo run
        where steps reached the worker 2 s late)."""
        finding = Finding(
            kind="over_eviction",
            category="healthy",
            severity=Severity.INFO,
            action=Action.NONE,
            job=self.job,
            evidence={
                "capture_id": self.capture_id,
                "verdict": Verdict.HEALTHY.value,
                "reason": "the job took a step after the capture was requested: not a hang",
                "stalled_since_ms": self.stalled_since_ms,
                "last_step_ms": last_step_ms,
                "dumps": len(self.dumps),
            },
        )
        return _finding_detection(
            finding,
            self.requested_ms,
            now_ms,
            self.capture_id,
            message="healthy: the job took a step after the capture was requested, no group to evict",
        )

    def failed(self, error: str, now_ms: int) -> Detection:
        """The detection for an analysis that raised: stop-time diagnosis instead of an eviction."""
        finding = Finding(
            kind="aggregation_failed",
            category="job_hang",
            severity=Severity.ERROR,
            action=Action.DIAGNOSE,
            job=self.job,
            evidence={"error": error, "capture_id": self.capture_id},
        )
        return _finding_detection(finding, self.requested_ms, now_ms, self.capture_id)


def _finding_detection(f: Finding, source_ts_ms: int, now_ms: int, key: str, message: str = "") -> Detection:
    return detection_from_finding(
        f, job=f.job or "", source_ts_ms=source_ts_ms, now_ms=now_ms, source_key=key, message=message
    )


class Captures:
    """A worker's captures: at most one pending per job, ``cooldown_s`` between a job's captures.

    :meth:`start` opens a capture for an ``aggregate`` decision (its commands come from
    :meth:`commands`), :meth:`add` files a dump under its capture, :meth:`due` hands over the
    captures that are complete or past their deadline, for :meth:`Capture.analyze`.
    """

    def __init__(self, config: AggregationConfig | None = None) -> None:
        self.config = config or AggregationConfig()
        self.pending: dict[str, Capture] = {}  # capture_id -> capture
        self.last_capture_ms: dict[str, int] = {}  # job -> when its last capture was requested
        #: capture_id -> what has answered so far (not state: the dumps are asked for again after
        #: a restore, and this is rebuilt from them).
        self._answers: dict[str, _Answers] = {}
        #: job -> when :meth:`due` handed its capture over for analysis: until :meth:`extend` says
        #: whether it re-opens, no new capture of the job starts (not state: transient).
        self.analysing: dict[str, int] = {}
        #: job -> whether its last capture was a hang's (not state: after a restore the cooldown
        #: holds for either kind).
        self._last_was_hang: dict[str, bool] = {}
        #: jobs whose last hang capture the Flight Recorder judged slow, not hung: the next hang
        #: capture need not wait the cooldown (a real hang has its collective stuck by then, and
        #: waiting 60 s to see it would cost more than the look).  Not state: transient.
        self._recheck: set[str] = set()

    def wants(self, job: str, now_ms: int, hang: bool = False, take_over: bool = True) -> bool:
        """Whether a new capture of ``job`` may start now: none pending or being analysed, and the
        cooldown over.  The cooldown is between captures of one kind: a ``hang``'s capture ignores
        it after a fail-slow one and a fail-slow one after a hang's (a different condition).  A
        ``hang``'s capture takes over a pending fail-slow capture (a stuck job's stacks decide, not
        a vote on a moving one) when ``take_over`` (the caller knows the job has not stepped
        since that capture began); else it waits for it."""
        since = self.analysing.get(job)
        if since is not None and now_ms - since < ANALYSIS_GRACE_MS:
            return False
        mine = [cid for cid, c in self.pending.items() if c.job == job]
        if mine:
            if not (hang and take_over) or any(self.pending[cid].rounds <= 1 for cid in mine):
                return False
            for cid in mine:
                self.drop(cid)
            return True
        last_was_hang = self._last_was_hang.get(job)
        if hang and (last_was_hang is False or job in self._recheck):
            return True
        if not hang and last_was_hang is True:
            return True
        return now_ms - self.last_capture_ms.get(job, -(10**15)) >= self.config.cooldown_s * 1000

    def start(self, dec: Decision, topology: JobTopology | None, now_ms: int) -> Capture | Detection:
        """Open the capture asked for by ``dec``; without machines to ask, a diagnose detection."""
        if topology is None or not topology.machines:
            # Without a topology the stacks cannot be localised: stop-time diagnosis instead.
            finding = Finding(
                kind="aggregation_unavailable",
                category="job_hang",
                severity=Severity.ERROR,
                action=Action.DIAGNOSE,
                job=dec.job,
                evidence={"reason": "no job spec with machines", "decision_id": dec.decision_id},
            )
            return _finding_detection(finding, dec.ts_ms, now_ms, dec.decision_id)
        cfg = self.config
        category = str(dec.evidence.get("detection", {}).get("category", ""))
        rounds = cfg.fail_slow_rounds if category in FAIL_SLOW_CATEGORIES else 1
        capture_id = stable_id("capture", dec.decision_id)
        deadline = now_ms + int((cfg.deadline_s + (rounds - 1) * cfg.fail_slow_interval_s) * 1000)
        cap = Capture(capture_id, dec.job, topology, rounds, deadline, now_ms, dec.decision_id)
        detection = dec.evidence.get("detection", {}) if isinstance(dec.evidence, dict) else {}
        if category in FAIL_SLOW_CATEGORIES and isinstance(detection.get("ranks"), list):
            world = topology.world_size
            cap.hint = tuple(sorted({r for r in detection["ranks"] if isinstance(r, int) and 0 <= r < world}))
        threshold = detection.get("threshold_s")
        if detection.get("kind") in HANG_KINDS and isinstance(threshold, int | float) and threshold > 0:
            cap.stall_threshold_s = float(threshold)
        if detection.get("kind") in HANG_KINDS and isinstance(detection.get("source_ts_ms"), int):
            cap.stalled_since_ms = int(detection["source_ts_ms"])
            if isinstance(detection.get("confirm_at_ms"), int):
                cap.not_before_ms = int(detection["confirm_at_ms"])
        cap.flight_recorder = cfg.flight_recorder and rounds <= 1
        cap.recheck = dec.job in self._recheck and rounds <= 1
        self._recheck.discard(dec.job)
        self.pending[capture_id] = cap
        self.last_capture_ms[dec.job] = now_ms
        self._last_was_hang[dec.job] = rounds <= 1
        return cap

    def commands(self, cap: Capture, now_ms: int | None = None) -> list[Command]:
        """One ``capture_stacks`` command per machine of the capture's job (for the rounds from
        ``cap.extended_from`` on, after :meth:`extend`)."""
        first = cap.extended_from
        args: dict[str, object] = {
            "capture_id": cap.capture_id,
            "rounds": cap.rounds - first,
            "interval_s": self.config.fail_slow_interval_s,
        }
        if first:
            args["first_round"] = first
        elif cap.flight_recorder:
            args["flight_recorder"] = True
        return [
            Command(
                command_id=stable_id(cap.capture_id, node, *([str(first)] if first else [])),
                ts_ms=cap.requested_ms if now_ms is None else now_ms,
                kind=CommandKind.CAPTURE_STACKS,
                node=node,
                job=cap.job,
                args=dict(args),
            )
            for node in cap.topology.machines
        ]

    def extend(self, cap: Capture, det: Detection, now_ms: int) -> list[Command]:
        """Follow a close fail-slow vote: re-open ``cap`` (just judged, so no longer pending) for
        the more rounds its verdict asks for and return their commands; [] when the verdict
        stands (it asked for none, or :meth:`Capture.extra_rounds` follows none of them).

        The new rounds' deadline counts what one round took in the batch just judged
        (:meth:`Capture.round_pace_s`, at least ``fail_slow_interval_s`` and at most that plus
        ``deadline_s``): on a loaded machine each round's dumps take seconds, and a deadline of
        intervals alone lost the last round of every batch (demo run 2026-11-27 18:00:16)."""
        self.analysing.pop(cap.job, None)
        slow_not_hung = (
            det.kind == "over_eviction"
            and det.evidence.get("verdict") == Verdict.HEALTHY.value
            and det.evidence.get("decided_by") == "flight_recorder"
        )
        if slow_not_hung and not cap.recheck and cap.rounds <= 1:
            self._recheck.add(cap.job)
        analysis = det.evidence.get("evidence") if det.kind == "over_eviction" else None
        asked = analysis.get("more_rounds", 0) if isinstance(analysis, dict) else 0
        cfg = self.config
        bound = cfg.over_eviction.fail_slow_max_rounds
        more = cap.extra_rounds(asked, bound) if isinstance(asked, int) else 0
        if more <= 0:
            return []
        if any(c.job == cap.job for c in self.pending.values()):
            return []  # a hang's capture took over while this one was analysed: its verdict stands
        interval = cfg.fail_slow_interval_s
        pace = min(max(interval, cap.round_pace_s() or interval), interval + cfg.deadline_s)
        cap.extended_from = cap.rounds
        cap.rounds += more
        # The exporters wait one interval before the first new round (it must not sample the job
        # again right after the last one), hence ``more`` rounds at the pace of the last batch.
        cap.deadline_ms = now_ms + int((cfg.deadline_s + more * pace) * 1000)
        self.pending[cap.capture_id] = cap
        # The cooldown counts from the last rounds asked for, not from the first request.
        self.last_capture_ms[cap.job] = now_ms
        answers = self._answers[cap.capture_id] = _Answers()
        for d in cap.dumps:
            answers.add(d)
        return self.commands(cap, now_ms)

    def add(self, d: StackDump) -> bool:
        """File ``d`` under its pending capture; False if no capture of that id is pending."""
        cap = self.pending.get(d.capture_id)
        if cap is None:
            return False
        cap.add(d)
        self._answers.setdefault(d.capture_id, _Answers()).add(d)
        return True

    def add_fr(self, d: FlightRecorderDump) -> bool:
        """File a Flight Recorder answer under its pending capture; False if none is pending."""
        cap = self.pending.get(d.capture_id) if d.capture_id else None
        if cap is None:
            return False
        cap.add_fr(d)
        return True

    def drop(self, capture_id: str) -> None:
        """Forget a pending capture (its job moved to another worker)."""
        self.pending.pop(capture_id, None)
        self._answers.pop(capture_id, None)

    def complete(self, capture_id: str) -> bool:
        """Every rank's main process and every process of its tree answered in every round, and
        every rank's Flight Recorder when asked: the capture can be judged now, nothing more is
        coming (the timer would close it at its next tick; a hang's eviction waits for that
        tick otherwise)."""
        cap = self.pending.get(capture_id)
        answers = self._answers.get(capture_id)
        if cap is None or answers is None:
            return False
        if cap.fr_missing():
            return False  # every rank answers its recorder too (a dump or why not)
        # The rounds asked for last (an earlier round's missing answers were given up on).
        first = cap.extended_from
        mains = sum(1 for r, _ in answers.mains if r >= first)
        waiting = any(r >= first for r, _ in answers.outstanding)
        return mains >= (cap.rounds - first) * cap.topology.world_size and not waiting

    def due(self, now_ms: int, stream_now_ms: int | None = None) -> list[Capture]:
        """Remove and return the captures ready for analysis (complete or past their deadline);
        each must come back through :meth:`extend` once analysed.  ``stream_now_ms``: how far the
        worker has read the steps (:class:`~trainguard.detectors.windows.StreamClock`); a hang's
        capture waits for it (:meth:`caught_up`)."""
        ready = [
            cid
            for cid, cap in self.pending.items()
            if cap.ready(now_ms) and self.caught_up(cap, now_ms, stream_now_ms)
        ]
        for cid in ready:
            self._answers.pop(cid, None)
        out = [self.pending.pop(cid) for cid in ready]
        for cap in out:
            self.analysing[cap.job] = now_ms
        return out

    def caught_up(self, cap: Capture, now_ms: int, stream_now_ms: int | None) -> bool:
        """Whether the steps have been read far enough to judge ``cap``: a hang's capture is moot
        if the job stepped after it was asked for, and a step not read yet cannot say so.  Measured
        in a demo run: a worker 8 s behind its input on an overloaded host judged a job that
        stepped twice a second hung, and evicted a healthy group.  Waits ``max_judge_lag_s`` at
        most (a worker that never catches up must still answer a real hang)."""
        if stream_now_ms is None or cap.stalled_since_ms is None:
            return True
        judged_for = max(cap.requested_ms, cap.not_before_ms)
        if stream_now_ms >= judged_for:
            return True
        return now_ms - judged_for >= self.config.max_judge_lag_s * 1000


class _Answers:
    """The dumps one capture has received, counted as they come: whether it is complete is a set
    lookup, not a pass over every dump (a 10,000-rank capture is tens of thousands of dumps)."""

    def __init__(self) -> None:
        self.mains: set[tuple[int, int]] = set()  # (round, rank) with a good main-process dump
        self.pids: set[tuple[int, int]] = set()  # (round, pid) that answered
        self.outstanding: set[tuple[int, int]] = set()  # (round, pid) named in a tree, not yet seen

    def add(self, d: StackDump) -> None:
        self.pids.add((d.round, d.pid))
        self.outstanding.discard((d.round, d.pid))
        if d.role is ProcessRole.MAIN and d.rank >= 0 and not d.error:
            self.mains.add((d.round, d.rank))
            for p in d.process_tree:
                if (d.round, p.pid) not in self.pids:
                    self.outstanding.add((d.round, p.pid))
