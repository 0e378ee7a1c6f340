"""Thresholds of the over-eviction analysis (ByteRobust §5), one frozen config dataclass.

Load it with ``trainguard.schemas.config.load_config(OverEvictionConfig, mapping, env_prefix=...)``;
unknown keys are rejected there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.detectors.eviction import check_preference
from trainguard.schemas.typecheck import bounds


@dataclass(frozen=True)
class OverEvictionConfig:
    """Settings of :class:`~trainguard.detectors.stacks.classifier.OverEvictionClassifier`."""

    #: A root is only accepted when at least this fraction of the job waits on it (directly or
    #: through other waiting ranks).  In a real hang nearly every rank does; in a healthy
    #: snapshot waits are short and point at many different busy ranks.
    min_reach_fraction: float = field(default=0.5, metadata=bounds(0.0, 1.0))
    #: A root set larger than this fraction of the job localises nothing (e.g. every rank in
    #: the same collective): report it as no suspect instead of evicting half the job.
    max_root_fraction: float = field(default=0.5, metadata=bounds(0.0, 1.0))
    #: Fail-slow: rounds of a first capture, and how many more a close vote asks for at a time.
    #: ByteRobust uses 5.
    fail_slow_rounds: int = field(default=5, metadata=bounds(1, 10_000))
    #: Fail-slow: vote over at most this many (the most recent) rounds; a close vote asks for
    #: more rounds until there are this many, then it is judged on what it has.
    fail_slow_max_rounds: int = field(default=15, metadata=bounds(1, 10_000))
    #: Fail-slow: the chance of evicting a healthy job's group, spent over every test one capture
    #: may run (one per batch of rounds, and the straggler hint's besides the all-ranks one): a
    #: vote evicts when its chance p-value (``trainguard.detectors.stacks.significance``) is at most its
    #: share.  The bound holds under the test's null (independent rounds, roots uniformly random
    #: ranks); ranks that are systematically busy break it -- the bench measures real captures.
    fail_slow_alpha: float = field(default=0.03, metadata=bounds(0.0, 1.0))
    #: Fail-slow: a vote not significant but with a p-value at most this is close -- more rounds
    #: decide it (while there are fewer than ``fail_slow_max_rounds``).
    fail_slow_extend_p: float = field(default=0.5, metadata=bounds(0.0, 1.0))
    #: Seconds between fail-slow rounds in production (ByteRobust: 10 s); informs the capture
    #: side, the analysis itself only sees the rounds it is given.
    fail_slow_interval_s: float = field(default=10.0, metadata=bounds(0.0, 3600.0))
    #: The winning group must be flagged in at least this fraction of the rounds voted over, so
    #: that a healthy job, whose momentary stragglers differ per round, is not evicted.
    min_vote_fraction: float = field(default=0.6, metadata=bounds(0.0, 1.0))
    #: Several rounds are a hang (not fail-slow) when at most this fraction of ranks (but at
    #: least one rank) changed stack between rounds: the job made no progress.
    hang_max_changed_fraction: float = field(default=0.1, metadata=bounds(0.0, 1.0))
    #: Group kinds in eviction order: the first kind with one group holding every root wins.
    #: PP first follows ByteRobust's production unit (whole pipelines, §9).
    evict_preference: tuple[str, ...] = ("pp", "tp", "dp")
    #: A group spanning more than this share of the job's machines (or all of them: pure DDP's
    #: DP group) is not evicted: only the suspects' own machines are (``docs/design/over-eviction.md``).
    max_group_share: float = field(default=0.5, metadata=bounds(0.0, 1.0))
    #: A rank with no main-process dump is a candidate root (its process died or hangs so hard
    #: py-spy cannot attach).  False: it is ignored and nothing waiting on it is explained.
    missing_ranks_are_suspects: bool = True
    #: Frames per stack class kept in the evidence (innermost first).
    evidence_frames: int = field(default=8, metadata=bounds(1, 1000))
    #: When a process was dumped in both formats, which one the analysis reads.
    prefer_format: str = "json"

    def __post_init__(self) -> None:
        check_preference(self.evict_preference)
        if self.fail_slow_max_rounds < self.fail_slow_rounds:
            raise ValueError("fail_slow_max_rounds must be >= fail_slow_rounds")
        if self.prefer_format not in ("json", "txt"):
            raise ValueError("prefer_format must be 'json' or 'txt'")
