"""A worker's per-job metrics (trainguard.streams.metrics.JobCollector): read at every scrape from the job
monitors the training agent feeds -- the newest step's time, and whether a recovery works on the
job -- for the "job not training" alert.  Finished jobs are left out."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from trainguard.detectors.routing import TRAINING, DetectionPath
from trainguard.schemas.base import now_ms
from trainguard.schemas.control import ActionEvent, ActionPhase
from trainguard.schemas.workload import ProcessExit, TrainingStep
from trainguard.streams.config import WorkerConfig
from trainguard.streams.metrics import JobCollector, WorkerMetrics


def registry_for(path: DetectionPath) -> CollectorRegistry:
    m = WorkerMetrics()
    m.registry.register(JobCollector(path))  # as build_app registers it
    return m.registry


def test_the_newest_step_and_recoveries_per_training_job() -> None:
    path = DetectionPath(WorkerConfig())
    registry = registry_for(path)
    t0 = now_ms() - 60_000
    for rank in (0, 1):
        for step in (1, 2):
            path.findings(
                TRAINING, TrainingStep(job="a", rank=rank, step=step, ts_ms=t0 + step * 1000 + rank), t0
            )
    path.findings(TRAINING, TrainingStep(job="b", rank=0, step=7, ts_ms=t0), t0)
    last = "trainguard_job_last_step_timestamp_seconds"
    assert registry.get_sample_value(last, {"training_job": "a"}) == (t0 + 2001) / 1000
    assert registry.get_sample_value(last, {"training_job": "b"}) == t0 / 1000
    assert registry.get_sample_value("trainguard_job_recovering", {"training_job": "a"}) == 0

    # A recovery of job a starts (the action service's events reach every worker): a is recovering.
    ev = ActionEvent(
        event_id="e1", decision_id="d1", ts_ms=now_ms(), job="a", step="stop", phase=ActionPhase.STARTED
    )
    path.on_action(ev)
    assert registry.get_sample_value("trainguard_job_recovering", {"training_job": "a"}) == 1
    assert registry.get_sample_value("trainguard_job_recovering", {"training_job": "b"}) == 0
    # The label is not `job`: Prometheus's own scrape-job label would rename it.
    assert b'training_job="a"' in generate_latest(registry) and b'{job="a"}' not in generate_latest(registry)


def test_a_finished_job_is_not_reported() -> None:
    path = DetectionPath(WorkerConfig())
    registry = registry_for(path)
    t0 = now_ms()
    for rank in (0, 1):
        path.findings(TRAINING, TrainingStep(job="done", rank=rank, step=10, ts_ms=t0), t0)
    path.findings(TRAINING, ProcessExit(node="n", ts_ms=t0, pid=10, job="done", rank=0, exit_code=0), t0)
    last = "trainguard_job_last_step_timestamp_seconds"
    assert registry.get_sample_value(last, {"training_job": "done"}) == t0 / 1000  # rank 1 still runs
    path.findings(TRAINING, ProcessExit(node="n", ts_ms=t0, pid=11, job="done", rank=1, exit_code=0), t0)
    assert registry.get_sample_value(last, {"training_job": "done"}) is None
    # A crash is not a finish: a job whose rank died still counts as not training.
    path.findings(TRAINING, TrainingStep(job="crashed", rank=0, step=3, ts_ms=t0), t0)
    path.findings(TRAINING, ProcessExit(node="n", ts_ms=t0, pid=12, job="crashed", rank=0, exit_code=1), t0)
    assert registry.get_sample_value(last, {"training_job": "crashed"}) == t0 / 1000
