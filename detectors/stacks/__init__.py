"""Over-eviction analysis of py-spy stacks (ByteRobust §5): parse per-rank dumps, classify
frames with a pattern table, find the rank(s) a hung or slow job waits on, and name the
parallel group and machines to evict.  Pure: file reading at most, no network or subprocesses."""

from trainguard.detectors.stacks.analysis import RankState, RoundAnalysis, analyze_round, rank_states
from trainguard.detectors.stacks.classifier import OverEvictionClassifier
from trainguard.detectors.stacks.config import OverEvictionConfig
from trainguard.detectors.stacks.loader import RankDumps, Round, collect_round, load_dump_dir
from trainguard.detectors.stacks.model import DumpName, Frame, ProcessDump, ThreadStack
from trainguard.detectors.stacks.parse import DumpParser, StackParseError
from trainguard.detectors.stacks.patterns import PatternTable, Role, Rule
from trainguard.detectors.stacks.result import Evidence, OverEvictionResult, StackClass, Vote
from trainguard.detectors.stacks.roles import StackReader

__all__ = [
    "DumpName",
    "DumpParser",
    "Evidence",
    "Frame",
    "OverEvictionClassifier",
    "OverEvictionConfig",
    "OverEvictionResult",
    "PatternTable",
    "ProcessDump",
    "RankDumps",
    "RankState",
    "Role",
    "Round",
    "RoundAnalysis",
    "Rule",
    "StackClass",
    "StackParseError",
    "StackReader",
    "ThreadStack",
    "Vote",
    "analyze_round",
    "collect_round",
    "load_dump_dir",
    "rank_states",
]
