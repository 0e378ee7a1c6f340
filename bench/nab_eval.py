"""Evaluate the streaming metric detectors on labelled NAB series (real server metrics).

Usage::

    PYTHONPATH=. .venv/bin/python bench/nab_eval.py /work/shared/data/nab [--detectors a b] [--json]

``DATA_DIR`` holds NAB CSVs (``timestamp,value``) and ``label_windows.json`` (per NAB path, the
anomaly windows as ``[start, end]`` timestamps, ends inclusive).  Every detector runs in
streaming order, *score then learn*, on the samples ``{"value": v_t, "delta": v_t - v_(t-1)}``
(the delta lets a univariate series exercise the multivariate detectors and exposes jumps).

Metric (no point-adjust: a detected window does *not* turn its unflagged points into hits):

* NAB's probationary period, the first 15 % of each file, is not scored; windows that end
  inside it are dropped, windows straddling its end are clipped.
* **point precision** = flagged points inside a label window / all flagged points;
* **window recall** = label windows flagged at least once / label windows;
* **F1** = harmonic mean of point precision and window recall (the "composite F-score" of
  Garg et al., 2022, IEEE TNNLS, "An evaluation of anomaly detection and diagnosis in multivariate
  time series").  "Overall" sums the counts over files (micro average) before dividing.
* ``chance_p`` is the fraction of scored points inside windows: the point precision of random
  flags, to read precision against (NAB windows are wide).
* ``auc`` is the threshold-free point-level ROC AUC of the raw scores against in-window labels
  (overall: the unweighted mean over files).

Threshold (never looks at labels, same rule for every file and detector): the ``q`` quantile
(default 0.99) of the detector's scores over the second half of the probationary period (the
first half is the detector's own warm-up).  Points scoring strictly above it are flagged.

The bench runs the detectors with the parameters in :data:`BENCH_PARAMS` (Isolation Forest
refits every 256 samples instead of 128, to keep the run short); the autoencoder is trained
on every ``--ae-stride``-th sample only (default 1: no striding), scoring every sample.
Progress (detector and file, files done of all, ETA) goes to stderr; stdout holds the tables or
the JSON only.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainguard.detectors.base import AnomalyDetector
from trainguard.detectors.registry import build, registered
from trainguard.infra.progress import Progress, quiet

PROBATION_FRACTION = 0.15  # NAB's probationary period
DEFAULT_Q = 0.99
BENCH_PARAMS: dict[str, dict[str, Any]] = {
    "ewma_zscore": {},
    "isolation_forest": {"refit_every": 256},
    # Two features (value, delta): a one-unit bottleneck.
    "autoencoder": {"code": 1, "hidden": 8, "refit_every": 256},
}


class RobustZ:
    """The baseline every detector must beat: ``|x - median| / (1.4826 MAD)`` of each feature over
    its last ``window`` learned values (the largest over features), the textbook robust z-score."""

    def __init__(self, window: int = 256, warmup: int = 16) -> None:
        self.window, self.warmup = window, warmup
        self.history: dict[str, list[float]] = {}

    def score_one(self, x: dict[str, float]) -> float:
        best = 0.0
        for k, v in x.items():
            h = self.history.get(k, [])
            if len(h) < self.warmup:
                continue
            arr = np.asarray(h)
            med = float(np.median(arr))
            mad = 1.4826 * float(np.median(np.abs(arr - med)))
            best = max(best, abs(v - med) / max(mad, 1e-9 + 0.01 * abs(med)))
        return best

    def learn_one(self, x: dict[str, float]) -> None:
        for k, v in x.items():
            h = self.history.setdefault(k, [])
            h.append(v)
            if len(h) > self.window:
                del h[0]


class AlwaysNormal:
    """The floor: never flags anything (every score 0, below any threshold)."""

    def score_one(self, x: dict[str, float]) -> float:
        return 0.0

    def learn_one(self, x: dict[str, float]) -> None:
        return None


#: reference rows next to the detectors: the robust z-score baseline and the never-flagging floor.
BASELINES: dict[str, Any] = {"baseline:robust_z": RobustZ, "baseline:always_normal": AlwaysNormal}


@dataclass
class Counts:
    """Confusion counts of one series (or a sum of series)."""

    points: int = 0  # scored points (after probation)
    in_window: int = 0  # scored points inside a label window
    flagged: int = 0
    true_pos: int = 0  # flagged points inside a label window
    windows: int = 0
    detected: int = 0  # windows with at least one flagged point

    def __add__(self, other: Counts) -> Counts:
        return Counts(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    @property
    def precision(self) -> float:
        return self.true_pos / self.flagged if self.flagged else 0.0

    @property
    def recall(self) -> float:
        return self.detected / self.windows if self.windows else 0.0

    @property
    def f1(self) -> float:
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p + r else 0.0

    @property
    def chance_precision(self) -> float:
        return self.in_window / self.points if self.points else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "precision": self.precision,
            "window_recall": self.recall,
            "f1": self.f1,
            "chance_p": self.chance_precision,
        }


def astuple(c: Counts) -> tuple[int, ...]:
    return (c.points, c.in_window, c.flagged, c.true_pos, c.windows, c.detected)


def window_indices(timestamps: Sequence[datetime], windows: Iterable[Sequence[str]]) -> list[tuple[int, int]]:
    """Label windows as inclusive ``(first, last)`` sample indices; empty windows are dropped."""
    ts = np.array(timestamps, dtype="datetime64[us]")
    out = []
    for start, end in windows:
        lo = int(np.searchsorted(ts, np.datetime64(datetime.fromisoformat(start)), side="left"))
        hi = int(np.searchsorted(ts, np.datetime64(datetime.fromisoformat(end)), side="right")) - 1
        if lo <= hi:
            out.append((lo, hi))
    return out


def evaluate_flags(flags: np.ndarray, windows: Sequence[tuple[int, int]], start: int) -> Counts:
    """Counts for boolean ``flags`` against inclusive index ``windows``, ignoring indices < ``start``.

    >>> flags = np.zeros(100, dtype=bool); flags[[5, 50, 51, 70]] = True
    >>> c = evaluate_flags(flags, [(45, 55), (80, 90)], start=20)
    >>> (c.flagged, c.true_pos, c.windows, c.detected, round(c.f1, 3))
    (3, 2, 2, 1, 0.571)
    """
    labels = np.zeros(len(flags), dtype=bool)
    c = Counts()
    for lo, hi in windows:
        lo = max(lo, start)
        if lo > hi:
            continue  # entirely inside the probationary period
        labels[lo : hi + 1] = True
        c.windows += 1
        c.detected += bool(flags[lo : hi + 1].any())
    f, lab = flags[start:], labels[start:]
    c.points, c.in_window = len(f), int(lab.sum())
    c.flagged, c.true_pos = int(f.sum()), int((f & lab).sum())
    return c


def probation_threshold(scores: np.ndarray, q: float = DEFAULT_Q) -> float:
    """The ``q`` quantile of scores over the second half of the probationary period."""
    end = int(len(scores) * PROBATION_FRACTION)
    calib = scores[end // 2 : end]
    return float(np.quantile(calib, q)) if len(calib) else float("inf")


def samples(values: Iterable[float]) -> Iterator[dict[str, float]]:
    """The bench's feature dicts: the value and its first difference."""
    prev = None
    for v in values:
        yield {"value": v, "delta": 0.0 if prev is None else v - prev}
        prev = v


def stream_scores(
    detector: AnomalyDetector | Any, values: Sequence[float], learn_stride: int = 1
) -> np.ndarray:
    """Scores of ``values`` in streaming order (score, then learn every ``learn_stride``-th)."""
    out = np.empty(len(values))
    for i, x in enumerate(samples(values)):
        out[i] = detector.score_one(x)
        if i % learn_stride == 0:
            detector.learn_one(x)
    return out


def point_auc(scores: np.ndarray, windows: Sequence[tuple[int, int]], start: int) -> float | None:
    """Point-level ROC AUC of scores after ``start``; ``None`` without both classes."""
    from sklearn.metrics import roc_auc_score

    labels = np.zeros(len(scores), dtype=bool)
    for lo, hi in windows:
        labels[lo : hi + 1] = True
    lab = labels[start:]
    if lab.all() or not lab.any():
        return None
    return float(roc_auc_score(lab, scores[start:]))


def evaluate_series(
    scores: np.ndarray, windows: Sequence[tuple[int, int]], q: float = DEFAULT_Q
) -> tuple[Counts, float, float | None]:
    """Threshold by :func:`probation_threshold`, then count; returns (counts, threshold, auc)."""
    threshold = probation_threshold(scores, q)
    start = int(len(scores) * PROBATION_FRACTION)
    counts = evaluate_flags(scores > threshold, windows, start)  # all-zero scores: nothing flagged
    return counts, threshold, point_auc(scores, windows, start)


def load_series(path: Path) -> tuple[list[datetime], list[float]]:
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    return [datetime.fromisoformat(r["timestamp"]) for r in rows], [float(r["value"]) for r in rows]


def run(
    data_dir: Path, names: Sequence[str], q: float, ae_stride: int, progress: Progress | None = None
) -> dict[str, Any]:
    """Every detector on every file; ``progress`` counts the (detector, file) pairs done."""
    labels = json.loads((data_dir / "label_windows.json").read_text())
    results: dict[str, Any] = {"metric": METRIC, "q": q, "detectors": {}}
    bar = progress or quiet()
    bar.update(total=len(names) * len(labels))
    for name in names:
        per_file, total = {}, Counts()
        t0, c0 = time.perf_counter(), time.process_time()
        for nab_path, raw_windows in sorted(labels.items()):
            bar.update(detail=f"{name}: {Path(nab_path).name}")
            timestamps, values = load_series(data_dir / Path(nab_path).name)
            windows = window_indices(timestamps, raw_windows)
            stride = ae_stride if name == "autoencoder" else 1
            detector = BASELINES[name]() if name in BASELINES else build(name, BENCH_PARAMS.get(name, {}))
            scores = stream_scores(detector, values, stride)
            counts, threshold, auc = evaluate_series(scores, windows, q)
            per_file[Path(nab_path).name] = {**counts.summary(), "threshold": threshold, "auc": auc}
            total += counts
            bar.advance()
        results["detectors"][name] = {
            "params": BENCH_PARAMS.get(name, {}),
            "files": per_file,
            "overall": {**total.summary(), "auc": _mean_auc(per_file.values())},
            "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - c0,
        }
    return results


def _mean_auc(rows: Iterable[dict[str, Any]]) -> float | None:
    """Unweighted mean of the per-file AUCs (the overall row's ``auc``)."""
    aucs = [r["auc"] for r in rows if r["auc"] is not None]
    return float(np.mean(aucs)) if aucs else None


METRIC = (
    "point precision (flagged in-window / flagged), window recall (windows flagged >= once / windows), "
    "F1 = harmonic mean of the two; no point-adjust; first 15% of each file unscored; "
    "threshold = q-quantile of scores in the 2nd half of that probationary period (no labels)"
)


def _fmt(name: str, row: dict[str, Any]) -> str:
    auc = "  -  " if row.get("auc") is None else f"{row['auc']:.3f}"
    return (
        f"  {name:42s} {row['windows']:3d} {row['detected']:4d} {row['flagged']:7d} {row['true_pos']:6d} "
        f"{row['precision']:6.3f} {row['window_recall']:6.3f} {row['f1']:6.3f} {row['chance_p']:8.3f} {auc}"
    )


def print_report(results: dict[str, Any]) -> None:
    print(f"Metric: {results['metric']} (q={results['q']})")
    for name, res in results["detectors"].items():
        took = f"{res['seconds']:.1f} s wall, {res['cpu_seconds']:.1f} s CPU"
        print(f"\n{name}  params={res['params']}  ({took})")
        print(f"  {'file':42s} win  det flagged     tp  prec   w_rec    F1  chance_p  auc")
        for fname, row in res["files"].items():
            print(_fmt(fname, row))
        print(_fmt("OVERALL (micro)", res["overall"]))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_dir", type=Path, help="folder with the NAB CSVs and label_windows.json")
    parser.add_argument(
        "--detectors",
        nargs="+",
        default=[*sorted(registered()), *BASELINES],
        help="registry names or baselines",
    )
    parser.add_argument("--q", type=float, default=DEFAULT_Q, help="probation quantile for the threshold")
    parser.add_argument("--ae-stride", type=int, default=1, help="autoencoder learns every n-th sample")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    # stderr: the tables or the JSON on stdout stay as they were.
    with Progress("nab", unit="files") as bar, bar.ticking():
        results = run(args.data_dir, args.detectors, args.q, args.ae_stride, bar)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print_report(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
