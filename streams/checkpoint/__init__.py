"""Every-step asynchronous checkpoints with a peer backup outside the rank's parallel groups.

ByteRobust §6.3: a host-memory snapshot per step, the rank's shard on its own machine's disk and
a backup on a machine sharing no TP, PP or DP group with it, sent over TCP; a restore takes the
newest step every rank can load from the job's current machines.  Re-exported by
``trainguard.training`` (imported on first use there); torch is never imported here.
"""

from trainguard.streams.checkpoint.checkpointer import Checkpointer, CheckpointStats
from trainguard.streams.checkpoint.config import CheckpointConfig
from trainguard.streams.checkpoint.restore import RestoreResult
from trainguard.streams.checkpoint.store import Manifest, ShardError

__all__ = ["CheckpointConfig", "CheckpointStats", "Checkpointer", "Manifest", "RestoreResult", "ShardError"]
