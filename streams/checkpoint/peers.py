"""Which rank holds this rank's backup: one sharing none of its TP, PP and DP groups (§6.3).

The choice is the planning code's (:func:`trainguard.detectors.planning.backup_peers`): a
uniform shift of two coordinates, so every rank also holds exactly one peer's backup and an
over-evicted parallel group never takes a shard and its backup together.  A job with one real
parallel dimension (pure DP/ZeRO) has no such rank; there, as in the paper, the backup goes to
the same slot on the neighbouring machine.
"""

from __future__ import annotations

from trainguard.detectors.planning import PlanningError, backup_peers
from trainguard.schemas.topology import JobTopology
from trainguard.streams.checkpoint.config import CheckpointConfig


def backup_rank(cfg: CheckpointConfig) -> int | None:
    """The rank whose server stores ``cfg.rank``'s backups; None when the job is one machine.

    >>> cfg = CheckpointConfig(job="fig9", directory="/x", tp=2, pp=4, dp=2, ranks_per_machine=2, rank=8)
    >>> backup_rank(cfg)
    2
    >>> backup_rank(CheckpointConfig(job="ddp", directory="/x", dp=4, ranks_per_machine=2, rank=1))
    3
    """
    if cfg.backup_rank >= 0:
        return cfg.backup_rank
    topo = JobTopology(
        job=cfg.job, tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, ranks_per_machine=cfg.ranks_per_machine, order=cfg.order
    )
    if topo.num_machines < 2:
        return None
    try:
        peer = backup_peers(topo)[cfg.rank]
        if topo.machine_of(peer) != topo.machine_of(cfg.rank):
            return peer
    except PlanningError:
        pass  # one real parallel dimension: the neighbouring machine below
    rpm = cfg.ranks_per_machine
    slot = cfg.rank % rpm
    machine = (topo.machine_of(cfg.rank) + 1) % topo.num_machines
    # The last machine may be partly filled: its highest rank stands in for a missing slot.
    return min(machine * rpm + slot, cfg.world_size - 1)
