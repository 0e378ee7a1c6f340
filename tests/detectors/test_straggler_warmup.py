"""A rank's first steps after a (re)start are not judged for straggling.

``tests/fixtures/startup-steps.jsonl`` is the first 17 s of a real demo job (run
``demo-20261124-111057``, all 8 ranks, 359 steps): on its third step rank 6's median step time was
0.53 s against about 0.3 s for the others, the straggler detector called it a fail-slow rank, and
the 5-round stack vote that followed evicted two healthy machines 18 s into the run -- using up
both warm standbys, so the first real fault waited 12 s for a replacement.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainguard.detectors.job_monitor import JobMonitor, MonitorConfig
from trainguard.detectors.training import StragglerConfig
from trainguard.schemas.workload import TrainingStep

STARTUP = Path(__file__).resolve().parents[1] / "fixtures" / "startup-steps.jsonl"


def _stragglers(config: StragglerConfig) -> list[tuple[int, list[int]]]:
    monitor = JobMonitor("j", MonitorConfig(straggler=config))
    found = []
    for line in STARTUP.read_text().splitlines():
        step = TrainingStep(**json.loads(line))
        monitor.on_step(step, step.ts_ms)
        found += [(step.ts_ms, d.ranks) for d in monitor.check(step.ts_ms) if d.kind == "straggler"]
    return found


def test_judging_a_fresh_job_from_its_first_steps_finds_a_straggler_that_is_not_one() -> None:
    assert _stragglers(StragglerConfig(min_slowdown=1.5, warmup_steps=0))  # what the run did


def test_with_the_first_steps_left_out_the_fresh_job_has_no_straggler() -> None:
    assert _stragglers(StragglerConfig(min_slowdown=1.5)) == []  # the default: 5 steps


def test_a_rank_that_stays_slow_after_its_warmup_is_still_found() -> None:
    monitor = JobMonitor("j", MonitorConfig(straggler=StragglerConfig(min_slowdown=1.5)))
    found = []
    for step in range(1, 30):
        for rank in range(8):
            ts = step * 400
            slow = 1.0 if rank == 5 else 0.3
            monitor.on_step(TrainingStep(job="j", rank=rank, step=step, ts_ms=ts, step_time_s=slow), ts)
        found += [d.ranks for d in monitor.check(step * 400) if d.kind == "straggler"]
    assert found and found[0] == [5]
