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
* **point recall** = flagged points inside a label window / all points inside label windows;
* **point F1** = harmonic mean of point precision and point recall: every point is labelled by
  NAB's windows (inside any window: anomalous) and judged on its own.  This is the F1 the
  comparison below ranks detectors by (#41).
* ``chance_p`` is the fraction of scored points inside windows: the point precision of random
  flags, to read precision against (NAB windows are wide).
* ``auc`` is the threshold-free point-level ROC AUC of the raw scores against in-window labels
  (overall: the unweighted mean over files).

Threshold (never looks at labels, same rule for every file and detector): the ``q`` quantile
(default 0.99) of the detector's scores over the second half of the probationary period (the
first half is the detector's own warm-up).  Points scoring strictly above it are flagged.

Comparison (printed after the per-detector tables, ``"comparison"`` in the JSON): per file, each
detector's point F1; the file's winner (highest point F1; ``-`` when all are 0); and per detector
how many files it beats the reference (``--reference``, default ``ewma_zscore``, the simplest) on,
strictly, by point F1 (a tie is not a win), with the median point F1 and median composite F1 over
files.

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
    "robust_zscore": {},
}
DEFAULT_REFERENCE = "ewma_zscore"


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
    def point_recall(self) -> float:
        return self.true_pos / self.in_window if self.in_window else 0.0

    @property
    def point_f1(self) -> float:
        """Point-wise F1: every point labelled by the windows, no point-adjust."""
        p, r = self.precision, self.point_recall
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
            "point_recall": self.point_recall,
            "point_f1": self.point_f1,
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
    >>> (c.in_window, round(c.point_recall, 3), round(c.point_f1, 3))  # 2 of 22 in-window points
    (22, 0.091, 0.16)
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
    "F1 = harmonic mean of the two; point recall (flagged in-window / in-window points), "
    "point F1 = harmonic mean of point precision and point recall; no point-adjust; "
    "first 15% of each file unscored; "
    "threshold = q-quantile of scores in the 2nd half of that probationary period (no labels)"
)


def compare(results: dict[str, Any], reference: str = DEFAULT_REFERENCE) -> dict[str, Any]:
    """Per-file point F1 of every detector, each file's winner, and each detector's wins over
    ``reference`` (strictly higher point F1 on a file); ``best`` is the detector with the most
    wins (ties broken by median point F1), chosen over all files at once, never per file.

    >>> row = lambda f1s: {"files": {f"f{i}": {"point_f1": v, "f1": v} for i, v in enumerate(f1s)}}
    >>> c = compare({"detectors": {"ref": row([0.1, 0.2, 0.0]), "new": row([0.3, 0.2, 0.0])}}, "ref")
    >>> c["winner"], c["wins"]["new"], c["best"]
    ({'f0': 'new', 'f1': 'ref new', 'f2': '-'}, {'wins': 1, 'ties': 2, 'losses': 0, 'files': 3}, 'new')
    """
    dets = results["detectors"]
    files = list(next(iter(dets.values()))["files"]) if dets else []
    point = {f: {n: dets[n]["files"][f]["point_f1"] for n in dets} for f in files}
    winner = {}
    for f, row in point.items():
        top = max(row.values(), default=0.0)
        winner[f] = " ".join(n for n, v in row.items() if v == top) if top > 0 else "-"
    wins: dict[str, dict[str, int]] = {}
    medians: dict[str, dict[str, float]] = {}
    for n in dets:
        medians[n] = {
            "point_f1": float(np.median([point[f][n] for f in files])) if files else 0.0,
            "f1": float(np.median([dets[n]["files"][f]["f1"] for f in files])) if files else 0.0,
        }
        if reference not in dets or n == reference:
            continue
        diffs = [point[f][n] - point[f][reference] for f in files]
        wins[n] = {
            "wins": sum(d > 0 for d in diffs),
            "ties": sum(d == 0 for d in diffs),
            "losses": sum(d < 0 for d in diffs),
            "files": len(files),
        }
    best = max(wins, key=lambda n: (wins[n]["wins"], medians[n]["point_f1"]), default=None)
    return {
        "reference": reference,
        "point_f1": point,
        "winner": winner,
        "wins": wins,
        "medians": medians,
        "best": best,
    }


def _fmt(name: str, row: dict[str, Any]) -> str:
    auc = "  -  " if row.get("auc") is None else f"{row['auc']:.3f}"
    return (
        f"  {name:42s} {row['windows']:3d} {row['detected']:4d} {row['flagged']:7d} {row['true_pos']:6d} "
        f"{row['precision']:6.3f} {row['window_recall']:6.3f} {row['f1']:6.3f} "
        f"{row['point_recall']:6.3f} {row['point_f1']:6.3f} {row['chance_p']:8.3f} {auc}"
    )


def print_comparison(comp: dict[str, Any]) -> None:
    """The per-file point-F1 table, each file's winner, and the win rates over the reference."""
    names = list(comp["medians"])
    if not names:
        return
    print(f"\nPoint F1 per file (no point-adjust); reference: {comp['reference']}")
    cols = [n[:16] for n in names]
    print(f"  {'file':42s} " + " ".join(f"{c:>16s}" for c in cols) + "  winner")
    for f, row in comp["point_f1"].items():
        print(f"  {f:42s} " + " ".join(f"{row[n]:16.3f}" for n in names) + f"  {comp['winner'][f]}")
    print(f"  {'median point F1':42s} " + " ".join(f"{comp['medians'][n]['point_f1']:16.3f}" for n in names))
    print(
        f"  {'median F1 (window recall)':42s} " + " ".join(f"{comp['medians'][n]['f1']:16.3f}" for n in names)
    )
    for n, w in comp["wins"].items():
        rate = w["wins"] / w["files"] if w["files"] else 0.0
        print(
            f"  {n} beats {comp['reference']} on {w['wins']}/{w['files']} files ({rate:.0%}); "
            f"ties {w['ties']}, loses {w['losses']}"
        )
    if comp["best"] is not None:
        w = comp["wins"][comp["best"]]
        rate = w["wins"] / w["files"] if w["files"] else 0.0
        print(f"  best detector: {comp['best']}, win rate {w['wins']}/{w['files']} = {rate:.0%}")


def print_report(results: dict[str, Any]) -> None:
    print(f"Metric: {results['metric']} (q={results['q']})")
    for name, res in results["detectors"].items():
        took = f"{res['seconds']:.1f} s wall, {res['cpu_seconds']:.1f} s CPU"
        print(f"\n{name}  params={res['params']}  ({took})")
        print(f"  {'file':42s} win  det flagged     tp  prec   w_rec    F1  p_rec  p_F1  chance_p  auc")
        for fname, row in res["files"].items():
            print(_fmt(fname, row))
        print(_fmt("OVERALL (micro)", res["overall"]))
    if "comparison" in results:
        print_comparison(results["comparison"])


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
    parser.add_argument(
        "--reference",
        default=DEFAULT_REFERENCE,
        help="detector the others' per-file wins are counted against",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    # stderr: the tables or the JSON on stdout stay as they were.
    with Progress("nab", unit="files") as bar, bar.ticking():
        results = run(args.data_dir, args.detectors, args.q, args.ae_stride, bar)
    results["comparison"] = compare(results, args.reference)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print_report(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
