"""The detection path's routing, in one place: which stage reads which topic, what each stage does
with an event, and how one stage's output reaches the next.

The stream worker runs one Faust agent per stage (``streams/agents/``) with Kafka between the
stages; the offline replay (:mod:`trainguard.detectors.replay`) calls the stages directly, on the records'
own clock.  Both go through :data:`INPUTS` and :class:`DetectionPath`, so they cannot drift:

=============  ===================================  ==============================================
stage          input topics                         what it does
=============  ===================================  ==============================================
inspection     GPU, NIC and host samples, log lines rule table with count/window thresholds
anomaly        GPU samples                          per-node anomaly score -> ``info`` detection
training       steps, exits                         one job monitor per job (exits need a job);
                                                    stall/straggler/stopped-job checks on a timer,
                                                    the last against the action events (every
                                                    worker follows them: :meth:`on_action`)
decide         detections                           decision policy, one decision per incident
                                                    (a recovery's end, from the action events,
                                                    ends its incident); a node-less eviction is
                                                    localised with the job's topology
aggregation    decisions, stack dumps               an ``aggregate`` decision opens a stack capture
                                                    (a command per machine); dumps are filed; due
                                                    captures become over-eviction detections
job_specs      job specs                            the job directory (latest spec per job wins)
=============  ===================================  ==============================================

Every output is an event for its registry topic (:func:`trainguard.schemas.topics.topic_for`): a detection
goes to the decide stage, a decision to aggregation, a command to the machines.  Lookups that
need I/O (a job's topology) are split in two: :func:`needs_topology` and
:meth:`DetectionPath.wants_capture` tell the caller whether to look it up, then
:meth:`DetectionPath.decide` and :meth:`DetectionPath.start_capture` act on the answer.  The
caller supplies the clock and decides where :meth:`DetectionPath.analyze` runs (the worker: in a
thread, off its event loop).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from trainguard.detectors.capture import FAIL_SLOW_CATEGORIES, AggregationConfig, Capture, Captures
from trainguard.detectors.decide import DecideConfig, DecisionPolicy
from trainguard.detectors.job_monitor import JobMonitor, MonitorConfig
from trainguard.detectors.node_anomaly import NodeAnomalyScorer
from trainguard.detectors.node_inspector import HostThresholds, NodeInspector
from trainguard.detectors.stopped_job import RecoveryStatus
from trainguard.detectors.windows import StreamClock
from trainguard.schemas.base import Event
from trainguard.schemas.control import ActionEvent, ActionPhase, Command, Decision, Detection, JobSpec
from trainguard.schemas.enums import Action
from trainguard.schemas.telemetry import GpuSampleBatch
from trainguard.schemas.topics import (
    DECISIONS,
    DETECTIONS,
    EXITS,
    FLIGHT_RECORDER,
    GPU,
    HOST,
    JOBS,
    LIVENESS,
    LOGS,
    NIC,
    STACKS,
    STEPS,
    Topic,
    topic_for,
)
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.workload import FlightRecorderDump, ProcessExit, RankLiveness, StackDump, TrainingStep

INSPECTION = "inspection"
ANOMALY = "anomaly"
TRAINING = "training"
DECIDE = "decide"
AGGREGATION = "aggregation"
JOB_SPECS = "job_specs"

#: stage -> the topics it consumes (the worker's agent for the stage subscribes to exactly these).
INPUTS: dict[str, tuple[Topic, ...]] = {
    INSPECTION: (GPU, NIC, HOST, LOGS),
    ANOMALY: (GPU,),
    TRAINING: (STEPS, EXITS, LIVENESS),
    DECIDE: (DETECTIONS,),
    AGGREGATION: (DECISIONS, STACKS, FLIGHT_RECORDER),
    JOB_SPECS: (JOBS,),
}
#: the stages that turn telemetry into detections (:meth:`DetectionPath.findings`).
TELEMETRY_STAGES = (INSPECTION, ANOMALY, TRAINING)
#: the aggregation stage's timer: how often due captures are closed and analysed.
CAPTURE_TICK_S = 1.0


def stages_of(topic: str) -> tuple[str, ...]:
    """The stages that consume ``topic`` (in :data:`INPUTS` order)."""
    return tuple(stage for stage, topics in INPUTS.items() if any(t.name == topic for t in topics))


def stages_for(ev: Event) -> tuple[str, ...]:
    """The stages that consume ``ev`` once it is published to its registry topic."""
    try:
        return stages_of(topic_for(ev).name)
    except KeyError:
        return ()


def needs_topology(det: Detection) -> bool:
    """Whether deciding on ``det`` needs the job's topology: an eviction without a node to evict."""
    return det.action is Action.EVICT and not det.node


def newer_spec(spec: JobSpec, known: JobSpec | None) -> bool:
    """Whether ``spec`` replaces ``known`` as its job's spec (the latest one wins)."""
    return known is None or known.ts_ms <= spec.ts_ms


class PathSettings(Protocol):
    """The detector settings of the path: the worker config and the replay config both have them."""

    @property
    def monitor(self) -> MonitorConfig: ...
    @property
    def decide(self) -> DecideConfig: ...
    @property
    def host(self) -> HostThresholds: ...
    @property
    def aggregation(self) -> AggregationConfig: ...
    @property
    def anomaly_detector(self) -> str: ...
    @property
    def anomaly_threshold(self) -> float: ...
    @property
    def anomaly_params(self) -> dict[str, Any]: ...


def _confirm_at_ms(dec: Decision) -> int:
    """When a hang decision's stall reaches its full threshold: the suspicion's ``confirm_at_ms``,
    or its own time for a hang reported at the threshold (or without the field)."""
    detection = dec.evidence.get("detection") if isinstance(dec.evidence, dict) else None
    at = detection.get("confirm_at_ms") if isinstance(detection, dict) else None
    return at if isinstance(at, int) and not isinstance(at, bool) else dec.ts_ms


class DetectionPath:
    """The detectors of every stage and what each stage does with its input; pure, no I/O.

    One instance per worker (or replay): the agents share it, each calling its own stage.
    """

    def __init__(self, config: PathSettings) -> None:
        self.config = config
        self.inspector = NodeInspector(host=config.host)
        self.anomaly = NodeAnomalyScorer()
        self.monitors: dict[str, JobMonitor] = {}
        #: job -> what the action service says of its recoveries (kept when a monitor is dropped:
        #: the action events reach every worker).
        self.recoveries: dict[str, RecoveryStatus] = {}
        self.policy = DecisionPolicy(config.decide)
        self.captures = Captures(config.aggregation)
        #: how far the worker has read the training stage's input: stall checks and the judging
        #: of hang captures go by it (a worker that lags must not take unread steps for a hang).
        self.stream_clock = StreamClock(idle_s=1.0)
        #: job -> a hang decision refused a capture, asked again by :meth:`deferred_captures`
        #: (not state: a restarted worker's stall check reports a hang that lasts again).
        self.deferred: dict[str, Decision] = {}
        #: job -> a fail-slow decision refused a capture, asked again the same way.
        self.deferred_slow: dict[str, Decision] = {}

    def reconfigure(self, config: PathSettings) -> None:
        """Apply changed thresholds to every live detector (their state is kept)."""
        self.config = config
        self.inspector.host = config.host
        self.policy.config = config.decide
        self.captures.config = config.aggregation
        for m in self.monitors.values():
            m.config = config.monitor
            m.spike.config, m.stall.config = m.config.spike, m.config.stall
            m.straggler.config, m.mfu.config = m.config.straggler, m.config.mfu
            m.stopped.config = m.config.stopped
            m.settle.config = m.config.settle
            m.slow_data.config = m.config.slow_data

    # -- inspection, anomaly, training: telemetry -> detections ---------------------------------

    def findings(self, stage: str, ev: Event, now_ms: int) -> list[Detection]:
        """What telemetry stage ``stage`` detects in ``ev``."""
        if stage == INSPECTION:
            return self.inspector.inspect(ev, now_ms)
        if stage == ANOMALY:
            if not isinstance(ev, GpuSampleBatch):
                return []
            c = self.config
            det = self.anomaly.observe(ev, c.anomaly_detector, c.anomaly_threshold, now_ms, c.anomaly_params)
            return [det] if det is not None else []
        if stage == TRAINING:
            if isinstance(ev, TrainingStep):
                return self.monitor(ev.job).on_step(ev, now_ms)
            if isinstance(ev, ProcessExit) and ev.job:  # an exit outside any job concerns no monitor
                return self.monitor(ev.job).on_exit(ev, now_ms)
            if isinstance(ev, RankLiveness):
                return self.monitor(ev.job).on_liveness(ev)
            return []
        raise ValueError(f"{stage!r} is not a telemetry stage")

    def monitor(self, job: str) -> JobMonitor:
        if job not in self.monitors:
            self.monitors[job] = JobMonitor(job, self.config.monitor)
        return self.monitors[job]

    def check(
        self, now_ms: int, stream_now_ms: int | None = None, keep: Callable[[str], bool] | None = None
    ) -> list[Detection]:
        """The training stage's timer: time-based findings (stall, stragglers) of every job.

        Jobs for which ``keep`` says no are forgotten first (their partition moved elsewhere)."""
        out: list[Detection] = []
        for job in list(self.monitors):
            if keep is not None and not keep(job):
                del self.monitors[job]
                continue
            out.extend(self.monitors[job].check(now_ms, stream_now_ms, self.recoveries.get(job)))
        return out

    def on_action(self, ev: ActionEvent) -> None:
        """Record what the action service did for a job: the stopped-job detector's context, and
        the end of a recovery ends its incident (the next fault of its kind decides anew)."""
        status = self.recoveries.setdefault(ev.job, RecoveryStatus())
        status.observe(ev.decision_id, ev.step, ev.phase.value, ev.ts_ms / 1000)
        if ev.step == "recovery" and ev.phase in (ActionPhase.SUCCEEDED, ActionPhase.FAILED):
            self.policy.recovery_ended(ev.job, ev.decision_id, succeeded=ev.phase is ActionPhase.SUCCEEDED)
        if ev.step == "recovery" and ev.phase is ActionPhase.STARTED:
            # A job being recovered is not captured for a suspicion from before it: the ranks
            # it would sample are the ones being replaced.
            self.deferred.pop(ev.job, None)
            self.deferred_slow.pop(ev.job, None)

    # -- decide: detections -> decisions --------------------------------------------------------

    def decide(self, det: Detection, now_ms: int, topology: JobTopology | None = None) -> Decision | None:
        """The decision for ``det`` (None: recorded only, or merged into an open incident).

        ``topology`` is needed only where :func:`needs_topology` says so."""
        return self.policy.decide(det, now_ms, topology if needs_topology(det) else None)

    def remember(self, dec: Decision) -> None:
        """Take ``dec``, decided before this path started, as decided (its incident, capture cooldown)."""
        self.policy.remember(dec)
        if dec.action is Action.AGGREGATE:
            last = self.captures.last_capture_ms.get(dec.job, dec.ts_ms)
            self.captures.last_capture_ms[dec.job] = max(last, dec.ts_ms)

    # -- aggregation: aggregate decisions and stack dumps -> commands, then detections ----------

    def wants_capture(self, dec: Decision, now_ms: int) -> bool:
        """Whether ``dec`` opens a stack capture now: an ``aggregate`` decision, none pending for its
        job and the cooldown over.  If so, look up the job's topology and :meth:`start_capture`."""
        if dec.action is not Action.AGGREGATE:
            return False
        detection = dec.evidence.get("detection") if isinstance(dec.evidence, dict) else None
        category = detection.get("category", "") if isinstance(detection, dict) else ""
        hang = category not in FAIL_SLOW_CATEGORIES
        take_over = hang and self._may_take_over(dec.job)  # only a hang's capture takes over
        if self.captures.wants(dec.job, now_ms, hang=hang, take_over=take_over):
            (self.deferred if hang else self.deferred_slow).pop(dec.job, None)
            return True
        # Refused (the cooldown after a capture of a stall that cleared, another capture open):
        # a hang or a decline reported once would otherwise never be captured.  Measured in demo
        # runs: a hang reported 1 s before the cooldown ended waited for the stopped-job check
        # (61 s) instead; an MFU decline decided while a hang suspicion's capture was open was
        # never localised (run 20261128-052330).
        (self.deferred if hang else self.deferred_slow)[dec.job] = dec
        return False

    def _may_take_over(self, job: str) -> bool:
        """Whether a hang's capture may take over ``job``'s pending fail-slow capture: not while
        the job has stepped since that capture began.  A slow rank's long steps set off hang
        suspicions; each took the fail-slow capture over and was then judged moot (the job
        stepped), and the slow rank was never localised (demo run 20261128-052330: five
        suspicions in 80 s).  A real hang waits for the fail-slow capture to end, then is asked
        again (:meth:`deferred_captures`)."""
        monitor = self.monitors.get(job)
        if monitor is None:
            return True
        slow = [c for c in self.captures.pending.values() if c.job == job and c.rounds > 1]
        return not any(monitor.last_step_ts_ms > c.requested_ms for c in slow)

    def deferred_captures(self, now_ms: int) -> list[Decision]:
        """The decisions refused a capture that may start one now (the aggregation timer): a
        hang's if its job has taken no step since it was decided (a job that stepped since was
        not hung), then a fail-slow one's.  A hang older than ``defer_hang_s``, a fail-slow
        suspicion older than ``defer_slow_s``, is forgotten."""
        out: list[Decision] = []
        limit_ms = self.config.aggregation.defer_hang_s * 1000
        for job, dec in list(self.deferred.items()):
            monitor = self.monitors.get(job)
            stepped = monitor is not None and monitor.last_step_ts_ms > dec.ts_ms
            if stepped or now_ms - dec.ts_ms > limit_ms:
                del self.deferred[job]
                # Not a hang (or no longer one to capture): its incident must not absorb the
                # next stall report, or a real hang within the incident's limit goes undecided.
                self.policy.hang_cleared(job)
                continue
            # No step since the decision and the stall past its full threshold: a real hang,
            # which takes over a fail-slow capture even of a job that stepped while it ran.
            confirmed = now_ms >= _confirm_at_ms(dec)
            take_over = confirmed or self._may_take_over(job)
            if self.captures.wants(job, now_ms, hang=True, take_over=take_over):
                del self.deferred[job]
                out.append(dec)
        # A fail-slow suspicion waits behind a hang's: a stepping job is no longer hung.
        slow_limit_ms = self.config.aggregation.defer_slow_s * 1000
        busy = {dec.job for dec in out} | set(self.deferred)  # one capture per job and tick
        for job, dec in list(self.deferred_slow.items()):
            if now_ms - dec.ts_ms > slow_limit_ms:
                del self.deferred_slow[job]
            elif job not in busy and self.captures.wants(job, now_ms):
                del self.deferred_slow[job]
                out.append(dec)
        return out

    def start_capture(self, dec: Decision, topology: JobTopology | None, now_ms: int) -> list[Event]:
        """Open the capture ``dec`` asks for: one ``capture_stacks`` command per machine of the job,
        or, without a topology to ask, a detection asking for stop-time diagnosis instead."""
        started = self.captures.start(dec, topology, now_ms)
        if isinstance(started, Detection):
            return [started]
        return list(self.captures.commands(started))

    def add_dump(self, dump: StackDump, by_job: bool = False) -> bool:
        """File ``dump`` under its pending capture (False: none pending).

        ``by_job``: under the pending capture of the dump's job, whatever its capture id (a replay
        of recorded dumps, which carry the recording run's capture ids)."""
        if not by_job:
            return self.captures.add(dump)
        cap = self._pending_of(dump.job)
        if cap is not None:
            cap.add(dump)
        return cap is not None

    def add_fr_dump(self, dump: FlightRecorderDump, by_job: bool = False) -> bool:
        """File a Flight Recorder answer under its pending capture (False: none pending; a
        ``timeout`` dump PyTorch wrote on its own belongs to no capture: it is for the sink).
        ``by_job`` as in :meth:`add_dump`."""
        if dump.trigger != "capture":
            return False
        if not by_job:
            return self.captures.add_fr(dump)
        cap = self._pending_of(dump.job)
        if cap is not None:
            cap.add_fr(dump)
        return cap is not None

    def _pending_of(self, job: str) -> Capture | None:
        return next((c for c in self.captures.pending.values() if c.job == job), None)

    def capture_complete(self, dump: StackDump | FlightRecorderDump) -> bool:
        """Whether ``dump`` completed its capture (judge it now rather than at the next tick)."""
        return self.captures.complete(dump.capture_id)

    def capture_wait_ms(self, capture_id: str, now_ms: int) -> int:
        """How long a complete capture must still wait before it is judged: a hang suspicion's
        until the stall would have become a hang (0 for any other, or none pending)."""
        cap = self.captures.pending.get(capture_id)
        return max(0, cap.not_before_ms - now_ms) if cap is not None else 0

    def due_captures(self, now_ms: int, stream_now_ms: int | None = None) -> list[Capture]:
        """The aggregation timer: the captures ready for :meth:`analyze` (complete or past deadline;
        a hang's once the steps are read up to it, see :meth:`Captures.caught_up`)."""
        return self.captures.due(now_ms, stream_now_ms)

    def moot_capture(self, cap: Capture, now_ms: int) -> Detection | None:
        """A healthy verdict for a hang's capture if the job took a step *after the capture was
        requested* (this worker watches the job's steps), else None: analyse it.  Not "after the
        last step seen at the report": the last steps of a real hang can reach the worker after
        the report (delivery lags 1-2 s), and taking those for progress left a real hang
        unevicted for a minute in a demo run.  A hung job cannot step after it was reported hung.
        Called on the event loop, where the monitors change."""
        monitor = self.monitors.get(cap.job)
        if cap.stalled_since_ms is None or monitor is None:
            return None
        last = monitor.last_step_ts_ms
        if last <= cap.requested_ms:
            return None
        # Nor does it hold the next capture back: the cooldown is against capturing a condition
        # that persists, and this one cleared (a real hang right after a false alarm would
        # otherwise wait out the cooldown before its capture).
        if self.captures.last_capture_ms.get(cap.job) == cap.requested_ms:
            del self.captures.last_capture_ms[cap.job]
        self.captures.analysing.pop(cap.job, None)  # judged: nothing to analyse or extend
        return cap.moot(last, now_ms)

    def analyze(self, cap: Capture, now_ms: int) -> Detection:
        """The over-eviction verdict on a closed capture; an analysis that raised asks for diagnosis
        instead (kind ``aggregation_failed``, the error in its evidence).  Thread-safe: it reads
        the config and the capture only."""
        try:
            agg = self.config.aggregation
            return cap.analyze(now_ms, agg.over_eviction, agg.flight_recorder_analysis)
        except Exception as exc:  # a bad capture must not stop the stage
            return cap.failed(str(exc), now_ms)

    def extend_capture(self, cap: Capture, det: Detection, now_ms: int) -> list[Command]:
        """The commands for more rounds when ``det`` (the verdict on ``cap``) is a close fail-slow
        vote, the capture re-opened for them; [] when ``det`` is the verdict to emit.  On the
        event loop (it changes the pending captures)."""
        return self.captures.extend(cap, det, now_ms)
