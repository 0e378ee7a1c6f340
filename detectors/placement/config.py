"""Settings of the placement planner (the ``placement`` section of the action service's config).

Load it with ``trainguard.schemas.config.load_config(PlacementConfig, mapping)``; unknown keys are errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.schemas.limits import NAMES
from trainguard.schemas.network import MachinePosition
from trainguard.schemas.typecheck import bounds


@dataclass(frozen=True)
class PlacementConfig:
    """Weights of the Arnold objective, the exact search's budget, positions from configuration."""

    #: False: every swap takes the standbys in pool order (ready ones first), as before the planner.
    enabled: bool = True
    #: weight of the largest DP-group spread (pods one data-parallel group spans).  DP groups
    #: all-reduce every gradient every step, the heaviest traffic of a dense job.
    alpha: float = field(default=1.0, metadata=bounds(0.0, 1e6))
    #: weight of the largest PP-group spread (pods one pipeline spans): activations cross the
    #: pipeline's stage boundaries point to point, less traffic than the gradients.
    beta: float = field(default=1.0, metadata=bounds(0.0, 1e6))
    #: search nodes the exact branch-and-bound may visit per decision; past it the best
    #: assignment found so far (at least the greedy heuristic's) is used and reported as heuristic.
    exact_nodes: int = field(default=1_000, metadata=bounds(0, 10_000_000))
    #: machine -> position from configuration (racks and pods of a cluster the executor cannot
    #: read); a JobSpec's own positions win over these.
    positions: dict[str, MachinePosition] = field(default_factory=dict, metadata=NAMES)
