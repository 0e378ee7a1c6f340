"""The NAB bench's reference rows: the robust z-score baseline finds a plain spike, the floor
flags nothing (their F1 bounds the detectors' in the README table)."""

from __future__ import annotations

import numpy as np

from bench.nab_eval import AlwaysNormal, RobustZ, evaluate_series, stream_scores


def _series() -> list[float]:
    rng = np.random.default_rng(0)
    values = list(10 + rng.normal(0, 0.5, 1000))
    values[700:705] = [40.0] * 5  # one clear incident
    return values


def test_robust_z_flags_a_spike_inside_its_window_only() -> None:
    scores = stream_scores(RobustZ(), _series())
    counts, threshold, auc = evaluate_series(scores, [(695, 710)])
    assert counts.windows == 1 and counts.detected == 1
    assert counts.true_pos >= 1 and counts.precision > 0.2
    assert auc is not None and auc > 0.5 and threshold > 0


def test_the_floor_flags_nothing() -> None:
    counts, _, _ = evaluate_series(stream_scores(AlwaysNormal(), _series()), [(695, 710)])
    assert (counts.flagged, counts.detected, counts.f1) == (0, 0, 0.0)
