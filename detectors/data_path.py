"""The data path's decision table: what TrainGuard does about a training job's data loader.

A loader goes wrong in two ways that look alike from outside (the job trains slower or not at
all) and call for different answers, so each has its row: the condition, the detector and
finding that see it, the action it recommends and why.  ``tests/detectors/test_data_path.py``
drives each row's detector into its condition and checks that it answers as the row says.

>>> [(r.condition, r.category, r.action.value) for r in DATA_PATH_ROWS]
[('loader hung', 'job_hang', 'aggregate'), ('loader slow', 'slow_data', 'ignore')]
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.enums import Action, Severity


@dataclass(frozen=True)
class DataPathRow:
    """One row: a loader condition and TrainGuard's answer to it."""

    condition: str
    #: the finding's category and kinds, and the detector (module.class) that produces it.
    category: str
    kinds: tuple[str, ...]
    detector: str
    action: Action
    severity: Severity
    why: str


DATA_PATH_ROWS: tuple[DataPathRow, ...] = (
    DataPathRow(
        condition="loader hung",
        category="job_hang",
        kinds=("hang_suspect", "hang"),
        detector="detectors.training.StepStallDetector",
        action=Action.AGGREGATE,
        severity=Severity.ERROR,
        why=(
            "A loader that stops yields no batch: its rank stops stepping, the others wait in the "
            "next collective, and the job's steps stop.  That is a hang like any other until the "
            "stacks say where: the capture finds the rank's main thread waiting on its DataLoader "
            "(role dataloader) and the over-eviction analysis evicts that rank's group, restarting "
            "the job from its checkpoint (with exact resume, on the same sample stream)."
        ),
    ),
    DataPathRow(
        condition="loader slow",
        category="slow_data",
        kinds=("slow_data", "slow_data_cleared"),
        detector="detectors.slow_data.SlowDataDetector",
        action=Action.IGNORE,
        severity=Severity.WARNING,
        why=(
            "The loader keeps up too slowly: the job steps, but a rank waits for data for a "
            "growing part of each step (its data_wait_s against its own history).  The machine "
            "is not sick: evicting or restarting would lose training time and meet the same "
            "loader again, and stop-time diagnostics would find nothing.  Recorded (a detection "
            "with the rank, the fraction and the baseline) for the operator, whose fix is the "
            "loader's workers, prefetching or storage; a slow_data_cleared finding ends it."
        ),
    ),
)


def row_for(category: str) -> DataPathRow:
    """The row of ``category``; KeyError if the data path has none."""
    for row in DATA_PATH_ROWS:
        if row.category == category:
            return row
    raise KeyError(category)
