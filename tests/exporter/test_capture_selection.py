"""Which processes a capture round dumps: every rank's processes, not the job's rank-less ones
(a launcher, idle warm spares) unless asked -- the verdict never reads those, and a round waits
for its slowest dump."""

from __future__ import annotations

from typing import Any

import pytest

from trainguard.schemas.enums import ProcessRole
from trainguard.schemas.workload import ThreadStack
from trainguard.streams.exporter.commands import capture_args, first_round_of
from trainguard.streams.exporter.config import StacksConfig
from trainguard.streams.exporter.sources.process import TrackedProcess
from trainguard.streams.exporter.stack_capture import StackCapturer

PROCESSES = [
    TrackedProcess(10, 1, 100, "python", "S", "python -m launcher", ProcessRole.OTHER, -1),
    TrackedProcess(11, 10, 101, "python", "S", "python train.py", ProcessRole.MAIN, 0),
    TrackedProcess(12, 11, 102, "pt_data_worker", "S", "python train.py", ProcessRole.DATALOADER, 0),
    TrackedProcess(13, 10, 103, "python", "S", "python train.py", ProcessRole.MAIN, 1),
    TrackedProcess(14, 1, 104, "python", "S", "python -m standby --slot 0", ProcessRole.OTHER, -1),
    TrackedProcess(15, 10, 105, "python", "Z", "python train.py", ProcessRole.MAIN, 2),
]


class Recorded(StackCapturer):
    """Records the pids it would have run py-spy on."""

    def __init__(self, cfg: StacksConfig) -> None:
        super().__init__(cfg, "n0", "j", lambda: PROCESSES, lambda _ev: None)
        self.dumped: list[int] = []

    def dump(self, pid: int, state: str = "") -> tuple[list[ThreadStack], str]:
        self.dumped.append(pid)
        return [], ""


def test_a_round_dumps_the_ranks_processes_and_skips_rank_less_and_dead_ones() -> None:
    cap = Recorded(StacksConfig())
    dumps = cap.capture_round("c1", 0)
    assert sorted(cap.dumped) == [11, 12, 13]  # 15 is a zombie: nothing to dump
    assert [(d.pid, d.rank, d.role) for d in dumps] == [
        (11, 0, ProcessRole.MAIN),
        (12, 0, ProcessRole.DATALOADER),
        (13, 1, ProcessRole.MAIN),
    ]
    # Each dump carries its rank's process tree (what completes the capture).
    assert [p.pid for p in dumps[0].process_tree] == [11, 12]


def test_rank_less_processes_are_dumped_when_configured() -> None:
    cap = Recorded(StacksConfig(unranked=True))
    cap.capture_round("c1", 0)
    assert sorted(cap.dumped) == [10, 11, 12, 13, 14]


def test_more_rounds_of_a_capture_are_numbered_on_from_first_round() -> None:
    """The worker asks a close fail-slow vote's capture for more rounds: their dumps must not
    reuse the first rounds' numbers (they would replace them in the vote)."""
    published: list[Any] = []
    cap = Recorded(StacksConfig())
    cap.publish = published.append
    cap.run("c1", 2, 0.0, first_round=5)
    assert sorted({d.round for d in published}) == [5, 6]
    assert capture_args({"rounds": 2, "first_round": 5}, 100) == (2, 0.0)
    assert first_round_of({"rounds": 2, "first_round": 5}, 100) == 5 and first_round_of({}, 100) == 0
    for bad in ({"first_round": -1}, {"first_round": 1.5}, {"first_round": "5"}):
        with pytest.raises(ValueError):
            first_round_of(bad, 100)


def test_a_stopped_rank_is_dumped_without_suspending_it() -> None:
    """A SIGSTOPped rank (the suspect of a hang) answers its stack: py-spy cannot suspend a stopped
    process, so it is read with --nonblocking (real py-spy, a real stopped process)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from trainguard.streams.exporter.stack_capture import find_py_spy

    # py-spy comes with the node extra, which scripts/setup.sh installs: its absence is a broken
    # setup, not a reason to skip.
    find_py_spy(StacksConfig().py_spy)
    code = "import time\ndef held_here():\n    time.sleep(120)\nheld_here()\n"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.2)
        cap = StackCapturer(StacksConfig(), "n0", "j", lambda: [], lambda _ev: None)
        threads, error = cap.dump(proc.pid, "T")
        assert error == ""
        assert any(f.function == "held_here" for t in threads for f in t.frames)
        # Stopped after the scan said it ran: the failed suspend is retried without suspending.
        threads, error = cap.dump(proc.pid, "S")
        assert error == "" and threads
    finally:
        proc.kill()
        proc.wait()
