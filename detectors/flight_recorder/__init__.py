"""PyTorch Flight Recorder dumps: read them safely (pickle or JSON) and find the collective a hung
job is stuck in, the ranks it waits for, and the parallel group to evict.  Pure: file reading at
most, no network or subprocesses."""

from trainguard.detectors.flight_recorder.analysis import (
    FlightRecorderConfig,
    FlightRecorderResult,
    GroupState,
    Mismatch,
    StuckCollective,
    analyze_dumps,
    dump_time_ns,
    untimed_config,
)
from trainguard.detectors.flight_recorder.events import dump_to_event, event_to_dump
from trainguard.detectors.flight_recorder.load import (
    Entry,
    FlightRecorderError,
    Group,
    RankDump,
    load_dump_dir,
    parse_dump,
)

__all__ = [
    "Entry",
    "FlightRecorderConfig",
    "FlightRecorderError",
    "FlightRecorderResult",
    "Group",
    "GroupState",
    "Mismatch",
    "RankDump",
    "StuckCollective",
    "analyze_dumps",
    "dump_time_ns",
    "dump_to_event",
    "event_to_dump",
    "load_dump_dir",
    "parse_dump",
    "untimed_config",
]
