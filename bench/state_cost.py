"""What a job monitor's worker state costs: snapshot time and size for a job of N ranks.

    .venv/bin/python bench/state_cost.py [--ranks 9600] [--steps 3] [--repeat 5]

A :class:`trainguard.detectors.routing.DetectionPath` is fed ``--steps`` steps of every rank of one job
(what the training agent sees), then the training stage's state is taken as the stream worker
takes it at every flush (:meth:`trainguard.detectors.keyed_state.PathState.snapshot`) ``--repeat`` times;
the best time, the document's size and a restore's time are printed.  No broker: pure code.
"""

from __future__ import annotations

import argparse
import time

from trainguard.detectors.keyed_state import PathState
from trainguard.detectors.routing import TRAINING, DetectionPath
from trainguard.schemas.workload import TrainingStep
from trainguard.streams.config import WorkerConfig

T0 = 1_795_000_000_000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=9600)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    path = DetectionPath(WorkerConfig())
    state = PathState(path)
    for step in range(args.steps):
        now = T0 + step * 10_000
        for rank in range(args.ranks):
            ev = TrainingStep(
                job="j",
                rank=rank,
                step=step,
                ts_ms=now + rank % 100,
                loss=1.0,
                node=f"n{rank // 8}",
                step_time_s=1.0,
            )
            list(path.findings(TRAINING, ev, now))
    best, doc = float("inf"), ""
    for _ in range(args.repeat):
        t = time.perf_counter()
        doc = state.snapshot(TRAINING, "j")
        best = min(best, time.perf_counter() - t)
    t = time.perf_counter()
    state.restore(TRAINING, "j", doc, T0 + args.steps * 10_000)
    restore = time.perf_counter() - t
    print(
        f"{args.ranks} ranks: snapshot {best * 1000:.1f} ms (best of {args.repeat}), {len(doc):,} bytes, "
        f"restore {restore * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
