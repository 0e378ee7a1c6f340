"""The slow-data detector on synthetic step streams: a healthy noisy loader is left alone, a
starving one is flagged once after the minimum duration and cleared when it recovers, restarts
warm up again, ranks are judged each against its own history; and through the job monitor the
finding is a recorded detection that decides nothing."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from trainguard.detectors.decide import DecisionPolicy
from trainguard.detectors.job_monitor import JobMonitor, MonitorConfig
from trainguard.detectors.slow_data import SlowDataConfig, SlowDataDetector, wait_fraction
from trainguard.schemas.config import ConfigError, load_config
from trainguard.schemas.enums import Action
from trainguard.schemas.workload import TrainingStep

COMPUTE_S = 0.5


def stream(
    rng: random.Random, n: int, frac: float, *, start_step: int = 0, t0: float = 0.0, blips: int = 0
) -> list[tuple[int, float, float, float]]:
    """``n`` steps of (step, ts, step_time_s, data_wait_s): compute ~0.5 s with 10% noise, the
    loader's wait ``frac`` of the step (noisy), and every ``blips``-th step one slow batch."""
    out, t = [], t0
    for i in range(n):
        f = min(0.95, max(0.0, rng.gauss(frac, 0.02)))
        if blips and i % blips == blips - 1:
            f = 0.9  # one cold file: a single long wait
        compute = COMPUTE_S * rng.lognormvariate(0, 0.1)
        step_time = compute / (1 - f)
        t += step_time
        out.append((start_step + i, t, step_time, f * step_time))
    return out


def feed(d: SlowDataDetector, steps: list[tuple[int, float, float, float]], rank: int = 0) -> list:
    found = []
    for step, ts, st, wait in steps:
        f = d.observe(rank, step, ts, st, wait)
        if f is not None:
            found.append(f)
    return found


def test_healthy_noisy_loader_is_not_flagged() -> None:
    d = SlowDataDetector()
    rng = random.Random(1)
    # 3,000 steps with prefetching hiding most loading (5% wait) and a slow batch every 97 steps.
    assert feed(d, stream(rng, 3000, 0.05, blips=97)) == []
    assert d.starving() == []


def test_starving_loader_flagged_after_min_duration_then_cleared() -> None:
    cfg = SlowDataConfig()
    d = SlowDataDetector(cfg, job="j")
    rng = random.Random(2)
    healthy = stream(rng, 300, 0.05)
    starving = stream(rng, 400, 0.6, start_step=300, t0=healthy[-1][1])
    again = stream(rng, 100, 0.05, start_step=700, t0=starving[-1][1])
    assert feed(d, healthy) == []
    found = feed(d, starving)
    assert [f.kind for f in found] == ["slow_data"]  # once per episode, not once per step
    f = found[0]
    began = starving[0][1]
    # Not before the minimum duration, and within a step or two of it (steps are ~1.25 s now).
    assert cfg.min_duration_s <= f.ts - began <= cfg.min_duration_s + 3
    assert f.ranks == (0,) and f.category == "slow_data" and f.action is Action.IGNORE
    assert f.evidence["baseline_median"] == pytest.approx(0.05, abs=0.02)
    assert f.evidence["fraction"] == pytest.approx(0.6, abs=0.1)
    assert d.starving() == [0]
    cleared = feed(d, again)
    assert [c.kind for c in cleared] == ["slow_data_cleared"]
    # Cleared after ``clear_steps`` healthy steps, and the episode's start is kept for the record.
    assert cleared[0].ts == again[cfg.clear_steps - 1][1]
    assert cleared[0].evidence["starving_since"] == began
    assert d.starving() == []


def test_a_short_slowdown_is_not_an_episode() -> None:
    d = SlowDataDetector(SlowDataConfig(min_duration_s=60))
    rng = random.Random(3)
    healthy = stream(rng, 200, 0.05)
    brief = stream(rng, 30, 0.6, start_step=200, t0=healthy[-1][1])  # ~38 s
    assert brief[-1][1] - brief[0][1] < 60
    after = stream(rng, 200, 0.05, start_step=230, t0=brief[-1][1])
    assert feed(d, healthy + brief + after) == []


def test_restart_warms_up_again_and_ranks_have_their_own_history() -> None:
    cfg = SlowDataConfig(min_duration_s=10)
    d = SlowDataDetector(cfg)
    rng = random.Random(4)
    # Rank 1's loader always waits 30% of the step: its normal, not an episode.  Rank 0's is 5%.
    for rank, frac in ((0, 0.05), (1, 0.3)):
        assert feed(d, stream(rng, 200, frac), rank=rank) == []
    # A restart (the step goes back): the new process's first steps wait for workers to start.
    cold = [(150 + i, 300.0 + 2 * i, 2.0, 1.9) for i in range(cfg.warmup_steps)]
    assert feed(d, cold) == []
    # Rank 0 at 40%: far above its history.  Rank 1 at 33%: a little above its own, within
    # ``min_rise`` -- and far above rank 0's threshold, which is why each has its own baseline.
    t0 = 300.0 + 2 * cfg.warmup_steps
    r0 = feed(d, stream(rng, 100, 0.4, start_step=150 + cfg.warmup_steps, t0=t0), rank=0)
    r1 = feed(d, stream(rng, 100, 0.33, start_step=200, t0=t0), rank=1)
    assert [f.ranks for f in r0] == [(0,)] and r1 == []


def test_unusable_input_is_ignored() -> None:
    d = SlowDataDetector(SlowDataConfig(warmup_steps=0, min_samples=1))
    for i, (st, wait) in enumerate(
        [(None, 0.1), (0.5, None), (0.0, 0.0), (math.nan, 0.1), (0.5, -1.0), (True, 0.1)]
    ):
        assert d.observe(0, i, float(i), st, wait) is None
    assert d.threshold(0) is None  # nothing learned from any of them
    assert wait_fraction(0.5, 0.25) == 0.5


def test_config_rejects_unknown_keys() -> None:
    assert load_config(SlowDataConfig, {"min_duration_s": 30}).min_duration_s == 30
    with pytest.raises(ConfigError):
        load_config(SlowDataConfig, {"min_duraton_s": 30})


def test_job_monitor_records_it_and_decides_nothing() -> None:
    cfg = MonitorConfig(slow_data=SlowDataConfig(min_duration_s=5))
    m = JobMonitor("j", cfg)
    rng = random.Random(5)
    steps = stream(rng, 200, 0.05) + stream(rng, 50, 0.7, start_step=200, t0=0.0)
    # re-time the starving part after the healthy part
    t_end = steps[199][1]
    steps = steps[:200] + [(s, t_end + ts, st, w) for s, ts, st, w in steps[200:]]
    dets = []
    for step, ts, st, wait in steps:
        ev = TrainingStep(
            job="j", rank=3, step=step, ts_ms=int(ts * 1000), node="n7", step_time_s=st, data_wait_s=wait
        )
        dets += m.on_step(ev, ev.ts_ms)
    assert [(d.kind, d.category, d.action, d.node, d.ranks) for d in dets] == [
        ("slow_data", "slow_data", Action.IGNORE, "n7", [3])
    ]
    assert DecisionPolicy().decide(dets[0], now_ms=dets[0].ts_ms) is None  # recorded, not acted on
    # Steps without a data wait (older reporters) leave the detector out.
    m2 = JobMonitor("j", cfg)
    assert all(
        m2.on_step(TrainingStep(job="j", rank=0, step=i, ts_ms=i * 500), i * 500) == [] for i in range(300)
    )
    assert m2.slow_data.threshold(0) is None


RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "slow-data-steps.jsonl"


def test_recorded_loader_that_turned_slow() -> None:
    """``tests/fixtures/slow-data-steps.jsonl`` (``tests/fixtures/record_slow_data.py``): a real
    2-worker DataLoader, 50 ms of compute per step, items at 2 ms, then from step 300 to 550 at
    40 ms.  Slow, the two workers deliver in pairs: every other step waits ~60 ms (55%) and the
    next none -- and each new epoch (64 steps) waits once for its workers to start, healthy or not."""
    steps = [TrainingStep(**json.loads(line)) for line in RECORDED.read_text().splitlines()]
    ts_of = {s.step: s.ts_ms for s in steps}
    # The recording's slowdown lasts 20 s: a job's config can ask for a shorter minimum than 60 s.
    m = JobMonitor("recorded", MonitorConfig(slow_data=SlowDataConfig(min_duration_s=10)))
    found = [(s.step, d) for s in steps for d in m.on_step(s, s.ts_ms)]
    assert [(d.kind, d.ranks) for _, d in found] == [("slow_data", [0]), ("slow_data_cleared", [0])]
    (_, slow), (clear_step, _) = found
    began_ms = ts_of[300]
    assert 10_000 <= slow.source_ts_ms - began_ms <= 12_000
    assert 550 < clear_step <= 550 + 12
    assert slow.evidence["baseline_median"] < 0.05 and slow.evidence["fraction"] > 0.4
    # With the default minimum (60 s) the 20 s slowdown is left alone, and so are the healthy
    # parts' epoch starts with either.
    m = JobMonitor("recorded")
    assert [d for s in steps for d in m.on_step(s, s.ts_ms)] == []
