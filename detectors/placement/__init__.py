"""Topology-aware placement (Arnold): keep a job's communication groups in few network pods.

ByteDance's scheduler places a job so that ``alpha * max DP-group spread + beta * max PP-group
spread`` is small (spread: pods a group spans; +10.6% throughput at 9,600 GPUs).  Every swap of a
failed machine for a standby can undo that: a standby from another pod widens the groups of the
slot it fills.  This package keeps the objective through recoveries:

* :mod:`~trainguard.detectors.placement.layout` -- a job's DP and PP groups over machine slots, spreads;
* :mod:`~trainguard.detectors.placement.replace` -- which standby fills which leaving slot (exact branch and
  bound where small, a documented heuristic beyond);
* :mod:`~trainguard.detectors.placement.pool` -- which free machines to hold as standbys, so every pod of
  the job has one within reach;
* :mod:`~trainguard.detectors.placement.config` -- the weights and the search budget.

Pure: positions come in as data (:class:`trainguard.schemas.network.MachinePosition`); the action service
reads them from the JobSpec, configuration and the executor (:mod:`trainguard.actions.placement`).
"""

from trainguard.detectors.placement.config import PlacementConfig
from trainguard.detectors.placement.layout import Groups, Spread, measure
from trainguard.detectors.placement.pool import place_standbys, uncovered_pods
from trainguard.detectors.placement.replace import Replacement, choose_replacements, first_free

__all__ = [
    "Groups",
    "PlacementConfig",
    "Replacement",
    "Spread",
    "choose_replacements",
    "first_free",
    "measure",
    "place_standbys",
    "uncovered_pods",
]
