"""Training-signal detectors: NaN/spikes, step stalls, stragglers, MFU decline."""

from __future__ import annotations

import math
import random

import pytest

from trainguard.detectors.findings import Finding, worst
from trainguard.detectors.training import (
    MfuConfig,
    MfuDeclineDetector,
    SpikeConfig,
    SpikeDetector,
    StallConfig,
    StepStallDetector,
    StragglerConfig,
    StragglerDetector,
)
from trainguard.schemas.config import ConfigError, load_config
from trainguard.schemas.enums import Action, Severity

# --- NaN and spikes --------------------------------------------------------------------------------


def _warm(d: SpikeDetector, n: int, value: float = 2.0, metric: str = "loss") -> None:
    for i in range(n):
        assert d.observe(float(i), {metric: value * (1 + 0.01 * (i % 3))}, step=i) == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_inf_reported_from_the_first_step(bad: float) -> None:
    d = SpikeDetector(job="j")
    (f,) = d.observe(0.0, {"loss": 2.0, "grad_norm": bad}, step=7)
    assert (f.kind, f.category, f.severity, f.action, f.job) == (
        "nan",
        "nan_value",
        Severity.ERROR,
        Action.DIAGNOSE,
        "j",
    )
    assert f.evidence["metric"] == "grad_norm" and f.evidence["step"] == 7


def test_five_x_jump_is_a_spike_below_is_not() -> None:
    d = SpikeDetector(SpikeConfig(warmup=10))
    _warm(d, 10)
    assert d.observe(10.0, {"loss": 9.0}) == []  # 4.5x
    (f,) = d.observe(11.0, {"loss": 10.5})
    assert (f.kind, f.category) == ("spike", "loss_spike") and f.score == pytest.approx(10.5 / 2.02, rel=0.02)


def test_no_spike_judgement_during_warmup() -> None:
    d = SpikeDetector(SpikeConfig(warmup=5))
    _warm(d, 4)
    assert d.observe(4.0, {"loss": 100.0}) == []


def test_spikes_stay_out_of_the_baseline_until_a_regime_change() -> None:
    d = SpikeDetector(SpikeConfig(warmup=5, window=5, max_consecutive=4))
    _warm(d, 5)
    kinds = [len(d.observe(10.0 + i, {"loss": 50.0})) for i in range(6)]
    # four spikes in a row, then 50 is the new normal
    assert kinds == [1, 1, 1, 1, 0, 0]


def test_metrics_are_independent_and_garbage_ignored() -> None:
    d = SpikeDetector(SpikeConfig(warmup=3))
    _warm(d, 3, metric="loss")
    _warm(d, 3, value=1.0, metric="grad_norm")
    out = d.observe(5.0, {"loss": 2.0, "grad_norm": 6.0, "lr": "n/a", "flag": True})
    assert [f.category for f in out] == ["grad_norm_spike"]


def test_non_positive_baseline_never_flags() -> None:
    d = SpikeDetector(SpikeConfig(warmup=3))
    _warm(d, 3, value=-1.0)
    assert d.observe(3.0, {"loss": 5.0}) == []


# --- stalls ------------------------------------------------------------------------------------


def test_stall_reports_ranks_behind_and_last_steps() -> None:
    d = StepStallDetector(StallConfig(stall_s=600, precapture_fraction=0.5), job="j")
    for r in range(8):
        d.update(r, 50, ts=0.0)
    for r in range(8):
        if r != 6:
            d.update(r, 51, ts=30.0)
    assert d.check(now=329.0) is None  # under half the threshold
    # Past half of it: a suspicion (two-phase detection), saying when it becomes a hang.
    early = d.check(now=629.0)
    assert early is not None and early.kind == "hang_suspect" and early.ranks == (6,)
    assert early.evidence["confirm_in_s"] == pytest.approx(1.0)
    off = StepStallDetector(StallConfig(stall_s=600), job="j")  # the default: no early capture
    off.update(0, 50, ts=0.0)
    assert off.check(now=599.0) is None
    f = d.check(now=631.0, alive=dict.fromkeys(range(8), True))
    assert f is not None
    assert (f.kind, f.category, f.action, f.ranks) == ("hang", "job_hang", Action.AGGREGATE, (6,))
    assert (
        f.evidence["last_step"][6] == 50 and f.evidence["max_step"] == 51 and f.score == pytest.approx(601.0)
    )


def test_no_hang_while_a_rank_is_dead_or_silent() -> None:
    d = StepStallDetector(StallConfig(stall_s=60, heartbeat_timeout_s=30))
    for r in range(4):
        d.update(r, 1, ts=0.0)
    assert d.check(now=100.0, alive={0: True, 1: True, 2: False, 3: True}) is None
    assert d.check(now=100.0, heartbeats={0: 95.0, 1: 95.0, 2: 10.0, 3: 99.0}) is None
    f = d.check(now=100.0, heartbeats={0: 95.0, 1: 95.0, 2: 90.0, 3: 99.0})
    assert f is not None and f.ranks == (0, 1, 2, 3) and f.evidence["ranks_behind"] == []


def test_rank_that_never_reported_is_behind() -> None:
    d = StepStallDetector(StallConfig(stall_s=60))
    d.update(0, 5, ts=0.0)
    f = d.check(now=100.0, alive={0: True, 1: True})
    assert f is not None and f.ranks == (1,) and f.evidence["last_step"] == {0: 5, 1: None}


def test_progress_resets_the_stall_and_garbage_is_ignored() -> None:
    d = StepStallDetector(StallConfig(stall_s=60, precapture_fraction=0))
    assert d.check(now=1e6) is None  # nothing known yet
    d.update(0, 1, ts=0.0)
    d.update(0, 1, ts=50.0)  # same step: not progress
    d.update(0, "2", ts=55.0)  # type: ignore[arg-type]
    d.update(0, 2, ts=float("nan"))
    assert d.check(now=61.0) is not None
    d.update(0, 2, ts=70.0)
    assert d.check(now=100.0) is None


# --- stragglers --------------------------------------------------------------------------------


def _feed(
    d: StragglerDetector, times: dict[int, float], steps: int = 5, t0: float = 0.0, noise: float = 0.0
) -> None:
    rng = random.Random(3)
    for s in range(steps):
        for r, v in times.items():
            d.observe(r, v * (1 + rng.uniform(-noise, noise)), ts=t0 + s)


def test_single_straggler_found_among_64_ranks() -> None:
    d = StragglerDetector(job="j")
    base = dict.fromkeys(range(64), 1.0)
    base[17] = 1.4
    _feed(d, base, noise=0.02)
    f = d.check(now=5.0)
    assert f is not None and (f.kind, f.category, f.action, f.ranks) == (
        "straggler",
        "fail_slow",
        Action.AGGREGATE,
        (17,),
    )
    assert f.evidence["ranks_compared"] == 64 and f.score is not None and f.score > 3.5


def test_uniform_ranks_have_no_straggler_even_with_zero_mad() -> None:
    d = StragglerDetector()
    _feed(d, dict.fromkeys(range(16), 1.0))
    assert d.check(now=5.0) is None
    d.observe(3, 1.005, ts=5.0)  # tiny deviation with MAD 0: floor keeps z finite and small
    assert d.check(now=5.0) is None


def test_slightly_slower_rank_below_min_slowdown_is_not_flagged() -> None:
    d = StragglerDetector(StragglerConfig(min_slowdown=1.2))
    times = {r: 1.0 + 0.001 * r for r in range(16)}
    times[5] = 1.15
    _feed(d, times)
    assert d.check(now=5.0) is None


def test_straggler_needs_enough_ranks_and_samples_and_forgets_old_data() -> None:
    d = StragglerDetector(StragglerConfig(min_ranks=4, min_samples=3, window_s=100))
    _feed(d, {0: 1.0, 1: 1.0, 2: 5.0}, steps=5)
    assert d.check(now=5.0) is None  # three ranks only
    d2 = StragglerDetector(StragglerConfig(window_s=100))
    _feed(d2, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 5.0}, steps=5)
    assert d2.check(now=5.0) is not None
    assert d2.check(now=500.0) is None  # everything aged out
    d2.observe(0, float("nan"), ts=1.0)
    d2.observe(0, -1.0, ts=1.0)
    d2.observe(0, "slow", ts=1.0)


# --- MFU ---------------------------------------------------------------------------------------


def test_mfu_decline_once_per_episode() -> None:
    d = MfuDeclineDetector(MfuConfig(warmup=10, sustain=3, decline_frac=0.1), job="j")
    for t in range(20):
        assert d.observe(float(t), 0.40 + 0.005 * (t % 2)) is None
    seen = [d.observe(20.0 + t, 0.30) for t in range(6)]
    hits = [f for f in seen if f is not None]
    assert len(hits) == 1 and seen[2] is hits[0]
    f = hits[0]
    assert (f.kind, f.category, f.action) == ("mfu_decline", "mfu_decline", Action.AGGREGATE)
    assert f.score == pytest.approx(1 - 0.30 / 0.4025, rel=0.02)
    assert d.observe(30.0, 0.40) is None  # recovered
    again = [d.observe(31.0 + t, 0.2) for t in range(3)]
    assert again[-1] is not None  # a new episode reports again


def test_mfu_short_dip_and_garbage() -> None:
    d = MfuDeclineDetector(MfuConfig(warmup=3, sustain=3))
    for t in range(3):
        d.observe(float(t), 50.0)
    assert [d.observe(3.0, 30.0), d.observe(4.0, 31.0), d.observe(5.0, 50.0)] == [None, None, None]
    for junk in (float("nan"), -1, 0, "x", None, True):
        assert d.observe(6.0, junk) is None


# --- configs and findings ---------------------------------------------------------------------


@pytest.mark.parametrize("cls", [SpikeConfig, StallConfig, StragglerConfig, MfuConfig])
def test_configs_load_and_reject_unknown_keys(cls: type) -> None:
    assert load_config(cls, {}) == cls()
    with pytest.raises(ConfigError, match="unknown"):
        load_config(cls, {"no_such_key": 1})


def test_config_ranges_are_checked() -> None:
    with pytest.raises(ConfigError, match="minimum"):
        load_config(SpikeConfig, {"factor": 0.5})
    assert (
        load_config(StallConfig, {}, env_prefix="TG_STALL", environ={"TG_STALL__STALL_S": "120"}).stall_s
        == 120.0
    )


def test_finding_dict_and_worst() -> None:
    a = Finding("spike", "loss_spike", Severity.WARNING, Action.DIAGNOSE, ranks=(1, 2), score=6.0)
    b = Finding("nan", "nan_value", Severity.ERROR, Action.DIAGNOSE, evidence={"value": "nan"})
    assert worst([a, b]) is b and worst([]) is None
    d = a.to_dict()
    assert d["ranks"] == [1, 2] and d["severity"] == "warning" and not math.isnan(d["score"])


def test_a_restart_that_recomputes_lost_steps_is_progress_not_a_hang() -> None:
    """After a NaN the job restarts from its last good checkpoint, 30 steps back: recomputing them
    (steps below the highest seen) is progress; only a frozen step is a stall."""
    d = StepStallDetector(StallConfig(stall_s=6.0), job="j")
    alive = {0: True, 1: True}
    for r in alive:
        d.update(r, 130, ts=0.0)
    t = 2.0
    for step in range(100, 131):  # the restarted generation, 0.4 s a step
        for r in alive:
            d.update(r, step, ts=t)
        t += 0.4
        assert d.check(now=t, alive=alive) is None
    assert d.check(now=t + 6.5, alive=alive) is not None  # frozen afterwards: a stall


def test_a_resumed_run_learns_its_loss_again_instead_of_calling_it_a_spike() -> None:
    """Measured on bench/own_job.py: after a restart the DDP job resumed from its snapshot two
    epochs back, its loss there was 5x the later steps' median, and the healthy replacement node
    got a loss-spike diagnosis.  A rank whose step goes back starts the baseline again; ranks a
    step apart (interleaved reports) do not."""
    d = SpikeDetector(SpikeConfig(warmup=3))
    for step in range(100, 110):
        for rank in (0, 1):
            assert d.observe(float(step), {"loss": 0.1}, step=step + rank % 2, source=rank) == []
    assert d.observe(110.0, {"loss": 0.9}, step=60, source=0) == []  # resumed: no spike
    for step in range(61, 64):
        assert d.observe(float(step), {"loss": 0.9}, step=step, source=0) == []
    (spike,) = d.observe(64.0, {"loss": 9.0}, step=64, source=0)  # a real jump is still one
    assert spike.kind == "spike"


def test_a_converged_loss_at_its_noise_floor_has_no_spikes() -> None:
    """Measured on bench/own_job.py: a small DDP job's loss at 7.5e-6 read 4.2e-5 (5.6x) on one
    batch as a loss spike; a spike must also rise ``min_delta`` above the median."""
    d = SpikeDetector(SpikeConfig(warmup=3))
    for step in range(10):
        assert d.observe(float(step), {"loss": 7.5e-6}, step=step, source=0) == []
    assert d.observe(10.0, {"loss": 4.2e-5}, step=10, source=0) == []
    (spike,) = d.observe(11.0, {"loss": 0.5}, step=11, source=0)
    assert spike.kind == "spike"
    strict = SpikeDetector(SpikeConfig(warmup=3, min_delta=0.0))
    for step in range(10):
        strict.observe(float(step), {"loss": 7.5e-6}, step=step, source=0)
    assert [f.kind for f in strict.observe(10.0, {"loss": 4.2e-5}, step=10, source=0)] == ["spike"]
