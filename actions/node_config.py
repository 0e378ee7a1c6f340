"""Settings of a node's way back (`trainguard nodes`): the ``nodes`` section of the config file and
``TRAINGUARD__NODES__*`` variables.  One dataclass; unknown keys are errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.actions.node_states import DAY_MS, QuarantinePolicy
from trainguard.schemas.config import ConfigError
from trainguard.schemas.typecheck import bounds


@dataclass(frozen=True)
class NodeReturnConfig:
    """How evicted nodes are validated and returned, and when they are quarantined instead."""

    #: where the nodes are: ``slurm`` (drain / reservation + srun / resume) or ``kubernetes``
    #: (cordon / a pod pinned to the node / uncordon).
    scheduler: str = "slurm"
    #: this many evictions of one node within ``quarantine_window_days`` quarantine it (0: never).
    quarantine_evictions: int = field(default=2, metadata=bounds(0, 1000))
    quarantine_window_days: float = field(default=14.0, metadata=bounds(0.001, 3650))
    #: the diag level a repaired node must pass.
    level: str = "standard"
    #: the validation command (argv) run on the node; ``{level}`` is replaced.  It must print
    #: ``trainguard diag --json`` lines on stdout (its exit status is judged as preflight judges it).
    validate_command: list[str] = field(
        default_factory=lambda: ["trainguard", "diag", "--level", "{level}", "--json"]
    )
    #: the validation's time limit; a run past it fails the node (a hang is a failure).
    validate_timeout_s: float = field(default=900.0, metadata=bounds(1, 86_400))
    #: evictions older than this are not read by ``trainguard nodes sync``.
    sync_days: float = field(default=30.0, metadata=bounds(0.001, 3650))
    #: Slurm: the cluster's slurm.conf (empty: ``SLURM_CONF`` or Slurm's default).
    slurm_conf: str = ""
    #: Slurm: the reservation holding a node during its validation is ``<prefix><node>``.
    reservation_prefix: str = "trainguard-validate-"
    #: Kubernetes: the namespace of validation pods, their image, and the kubeconfig (empty: in-cluster).
    namespace: str = "trainguard"
    image: str = ""
    kubeconfig: str = ""

    def __post_init__(self) -> None:
        if self.scheduler not in ("slurm", "kubernetes"):
            raise ConfigError(f"nodes.scheduler must be slurm or kubernetes, not {self.scheduler!r}")
        if self.level not in ("quick", "standard", "long"):
            raise ConfigError(f"nodes.level must be quick, standard or long, not {self.level!r}")
        if not self.validate_command:
            raise ConfigError("nodes.validate_command is empty")

    @property
    def policy(self) -> QuarantinePolicy:
        return QuarantinePolicy(self.quarantine_evictions, int(self.quarantine_window_days * DAY_MS))

    def command(self) -> list[str]:
        return [a.replace("{level}", self.level) for a in self.validate_command]
