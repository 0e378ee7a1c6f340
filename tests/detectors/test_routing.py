"""The detection path's routing (detectors/routing.py), shared by the worker's agents and the replay."""

from __future__ import annotations

import ast
from pathlib import Path

from trainguard.detectors.replay import OfflinePipeline, ReplayConfig
from trainguard.detectors.routing import (
    AGGREGATION,
    ANOMALY,
    DECIDE,
    INPUTS,
    INSPECTION,
    JOB_SPECS,
    TRAINING,
    DetectionPath,
    needs_topology,
    stages_for,
    stages_of,
)
from trainguard.schemas.control import Command, CommandKind, Decision, Detection, JobSpec
from trainguard.schemas.enums import Action, ProcessRole
from trainguard.schemas.topics import DECISIONS, DETECTIONS, GPU, HEARTBEATS, JOBS, STACKS
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.workload import FlightRecorderDump, LogLine, StackDump

ROOT = Path(__file__).resolve().parents[2]
XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus."
TOPO = JobTopology(job="j", tp=2, pp=1, dp=1, ranks_per_machine=1, machines=["m0", "m1"])


def _det(
    action: Action, node: str = "", category: str = "job_hang", ranks: tuple[int, ...] = ()
) -> Detection:
    return Detection(
        detection_id=f"d-{action.value}-{node}",
        ts_ms=1_000,
        job="j",
        kind="k",
        category=category,
        action=action,
        node=node,
        ranks=list(ranks),
        source_ts_ms=1_000,
    )


def test_each_topic_reaches_the_stages_that_consume_it() -> None:
    assert stages_of(GPU.name) == (INSPECTION, ANOMALY)
    assert stages_of(DETECTIONS.name) == (DECIDE,)
    assert stages_of(DECISIONS.name) == (AGGREGATION,)
    assert stages_of(STACKS.name) == (AGGREGATION,)
    assert stages_of(JOBS.name) == (JOB_SPECS,)
    assert stages_of(HEARTBEATS.name) == ()
    assert stages_for(_det(Action.EVICT, "n")) == (DECIDE,)
    assert stages_for(Command(command_id="c", ts_ms=1, kind=CommandKind.CAPTURE_STACKS, node="m0")) == ()


def test_every_agent_subscribes_to_its_stage_inputs_and_nothing_else() -> None:
    # The agents name their stage and subscribe to INPUTS[stage]: no topic list of their own.
    for stage in (INSPECTION, TRAINING, DECIDE, AGGREGATION):
        source = (ROOT / "streams" / "agents" / f"{stage}.py").read_text()
        calls = [
            ast.unparse(n)
            for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call) and ast.unparse(n.func) in ("ctx.faust_topics", "ctx.faust_topic")
        ]
        assert calls == ["ctx.faust_topics(*INPUTS[NAME])"], (stage, calls)
        assert f"NAME = {stage.upper()}" in source, stage


def test_the_anomaly_stage_runs_in_the_inspection_agent_on_the_batch_it_decoded() -> None:
    # No agent of its own: a second agent on the GPU topic decoded every GPU batch again.
    assert {t.name for t in INPUTS[ANOMALY]} <= {t.name for t in INPUTS[INSPECTION]}
    assert not (ROOT / "streams" / "agents" / f"{ANOMALY}.py").exists()
    source = (ROOT / "streams" / "agents" / f"{INSPECTION}.py").read_text()
    assert "path.findings(ANOMALY, ev, now)" in source


def test_an_xid_line_becomes_an_eviction_of_its_machine() -> None:
    path = DetectionPath(ReplayConfig())
    line = LogLine(node="n7", ts_ms=1_000, source="kernel", line=XID_79, job="j")
    (det,) = path.findings(INSPECTION, line, 1_001)
    assert det.action is Action.EVICT and not needs_topology(det)
    dec = path.decide(det, 1_002)
    assert dec is not None and dec.targets.machines == ["n7"]
    assert path.decide(det, 1_003) is None  # the same fault again: de-duplicated


def test_a_nodeless_eviction_is_localised_with_the_topology() -> None:
    det = _det(Action.EVICT, ranks=(1,), category="gpu_unavailable")
    assert needs_topology(det)
    assert DetectionPath(ReplayConfig()).decide(det, 2_000) is None  # nothing to evict without one
    dec = DetectionPath(ReplayConfig()).decide(det, 2_000, TOPO)
    assert dec is not None and dec.targets.machines == ["m1"]


def test_an_aggregate_decision_asks_every_machine_for_stacks_then_analyses_them() -> None:
    path = DetectionPath(ReplayConfig())
    dec = path.decide(_det(Action.AGGREGATE), 5_000)
    assert dec is not None and dec.action is Action.AGGREGATE
    assert path.wants_capture(dec, 5_000)
    cmds = path.start_capture(dec, TOPO, 5_000)
    assert sorted(c.node for c in cmds if isinstance(c, Command)) == ["m0", "m1"]
    assert not path.wants_capture(dec, 5_001)  # one capture per job at a time
    capture_id = str(cmds[0].args["capture_id"]) if isinstance(cmds[0], Command) else ""
    for rank in range(2):
        dump = StackDump(
            job="j", node=f"m{rank}", rank=rank, pid=10 + rank, capture_id=capture_id, ts_ms=5_100
        )
        assert dump.role is ProcessRole.MAIN and path.add_dump(dump)
    assert path.due_captures(5_150) == []  # a hang's capture waits for the Flight Recorders too
    for rank in range(2):
        fr = FlightRecorderDump(
            job="j", node=f"m{rank}", rank=rank, ts_ms=5_100, capture_id=capture_id, error="no dump within 5s"
        )
        assert path.add_fr_dump(fr)
    (cap,) = path.due_captures(5_200)  # every rank answered: due before the deadline
    verdict = path.analyze(cap, 5_200)
    assert (verdict.kind, verdict.evidence["capture_id"], verdict.evidence["dumps"]) == (
        "over_eviction",
        capture_id,
        2,
    )
    assert verdict.action is Action.NONE  # empty stacks: no group stands out, nobody evicted


def test_an_aggregate_decision_without_topology_asks_for_diagnosis() -> None:
    path = DetectionPath(ReplayConfig())
    dec = path.decide(_det(Action.AGGREGATE), 5_000)
    assert dec is not None
    (out,) = path.start_capture(dec, None, 5_000)
    assert isinstance(out, Detection) and out.action is Action.DIAGNOSE
    assert stages_for(out) == (DECIDE,)  # back to the decide stage, as on Kafka


def test_recorded_dumps_are_filed_under_the_jobs_pending_capture_in_a_replay() -> None:
    path = DetectionPath(ReplayConfig())
    dec = path.decide(_det(Action.AGGREGATE), 5_000)
    assert dec is not None
    path.start_capture(dec, TOPO, 5_000)
    dump = StackDump(job="j", node="m0", rank=0, pid=1, capture_id="from-the-recorded-run", ts_ms=5_100)
    assert not path.add_dump(dump)  # live: unknown capture id
    assert path.add_dump(dump, by_job=True)


def test_the_replay_routes_through_the_same_stages() -> None:
    pipeline = OfflinePipeline()
    spec = JobSpec(job="j", ts_ms=500, topology=TOPO)
    pipeline.feed(500, spec)
    pipeline.feed(1_000, _det(Action.EVICT, node="m0"))  # a recorded detection: ignored
    pipeline.feed(1_000, LogLine(node="m1", ts_ms=1_000, source="kernel", line=XID_79, job="j"))
    result = pipeline.finish()
    assert [(d.action, d.targets.machines) for d in result.decisions] == [(Action.EVICT, ["m1"])]
    assert pipeline.specs == {"j": spec}
    recorded = Decision(
        decision_id="x", ts_ms=2_000, job="j", action=Action.AGGREGATE, reason="hang", evidence={}
    )
    pipeline.feed(2_000, recorded)  # a recorded aggregate decision opens a capture
    assert [c.job for c in pipeline.path.captures.pending.values()] == ["j"]
    assert set(INPUTS) == {INSPECTION, ANOMALY, TRAINING, DECIDE, AGGREGATION, JOB_SPECS}
