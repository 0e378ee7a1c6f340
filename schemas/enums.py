"""Closed vocabularies shared by detectors, decisions and the action service.

Their ``.value`` strings are part of the wire contract and of ClickHouse rows: add members,
never rename them.
"""

from __future__ import annotations

from enum import StrEnum


class Action(StrEnum):
    """Recovery action recommended by a rule or detector, or decided for a job."""

    EVICT = "evict"  # stop, evict the target machines, swap in standbys, restart from checkpoint
    RESTART = "restart"  # restart in place (hot update), no machine change
    ROLLBACK = "rollback"  # roll back the most recent code change, in place
    DIAGNOSE = "diagnose"  # suspend and run stop-time diagnostics
    AGGREGATE = "aggregate"  # capture stacks of every rank and run the over-eviction analysis
    IGNORE = "ignore"  # known benign, recorded only
    NONE = "none"  # no rule matched


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


class ProcessRole(StrEnum):
    """What a process of a training job does; stack dumps and process trees carry it."""

    MAIN = "main"  # the rank's training process
    DATALOADER = "dataloader"  # torch DataLoader worker
    CHECKPOINT = "checkpoint"  # asynchronous checkpoint writer
    OTHER = "other"


class Verdict(StrEnum):
    """Outcome of the over-eviction analysis of a job's stacks."""

    HEALTHY = "healthy"
    HANG = "hang"
    FAIL_SLOW = "fail_slow"
