"""The data path's decision table: what TrainGuard does about a training job's data loader.

A loader goes wrong in ways that look alike from outside (the job trains slower or not at
all) and call for different answers, so each has its row: the condition, the detector and
finding that see it, the action it recommends and why.  ``tests/detectors/test_data_path.py``
drives each row's detector into its condition and checks that it answers as the row says.

With a shadow loader (:mod:`trainguard.streams.shadow_loader`) in the training loop, a hung or dead loader
is normally answered by the rank itself, within the stall: its standby takes over on the same
data position, and TrainGuard records the takeover.  TrainGuard still evicts when the loader is
not what failed -- when loader after loader fails on a rank (the machine, its storage mount or
the data source) the shadow loader gives up, the rank hangs or crashes, and the hang row acts.

>>> [(r.condition, r.category, r.action.value) for r in DATA_PATH_ROWS]  # doctest: +NORMALIZE_WHITESPACE
[('loader hung, shadow loader ready', 'loader_takeover', 'ignore'),
 ('loader hung, no shadow loader', 'job_hang', 'aggregate'),
 ('loaders keep failing', 'loader_failed', 'ignore'),
 ('loader slow', 'slow_data', 'ignore')]
"""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.schemas.enums import Action, Severity


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
        condition="loader hung, shadow loader ready",
        category="loader_takeover",
        kinds=("log_rule",),  # rule shadow-loader-takeover
        detector="trainguard.detectors.log_classifier.LogClassifier",
        action=Action.IGNORE,
        severity=Severity.WARNING,
        why=(
            "The rank's loader gave no batch within its threshold (or its workers died) and the "
            "standby loader, started and idle, took over on the same data position: the job lost "
            "the stall (about a second) and trains on.  Evicting would cost a restart and find a "
            "healthy machine.  The takeover line (stall, takeover time, lanes, position) is "
            "recorded as a detection; repeated ones on one machine are the operator's lead."
        ),
    ),
    DataPathRow(
        condition="loader hung, no shadow loader",
        category="job_hang",
        kinds=("hang_suspect", "hang"),
        detector="trainguard.detectors.training.StepStallDetector",
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
        condition="loaders keep failing",
        category="loader_failed",
        kinds=("log_rule",),  # rule shadow-loader-gave-up
        detector="trainguard.detectors.log_classifier.LogClassifier",
        action=Action.IGNORE,
        severity=Severity.ERROR,
        why=(
            "More takeovers than the shadow loader allows within its window: fresh loaders fail "
            "like the old ones, so the machine, its storage or the data source is sick, not a "
            "loader.  The shadow loader stops switching and the rank waits on its loader (a hang: "
            "the row above evicts its group, the stacks showing the wait in the loader) or raises "
            "the loader's error (a crash: restarted).  This line is the evidence beside them."
        ),
    ),
    DataPathRow(
        condition="loader slow",
        category="slow_data",
        kinds=("slow_data", "slow_data_cleared"),
        detector="trainguard.detectors.slow_data.SlowDataDetector",
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
