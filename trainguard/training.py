"""The training side of TrainGuard: the one module a training script imports.

What a rank uses:

- :class:`Reporter` -- step telemetry, exit reasons and Flight Recorder dumps, sent to the node's
  exporter over a Unix socket (never to Kafka: a training image needs no broker credentials);
- :class:`DataPosition`, :class:`ResumableSampler` and :class:`SeededSamples` -- where a rank is in
  its data, saved with every checkpoint, so a restart reads exactly the batches it would have read;
- :class:`Checkpointer` (with :class:`CheckpointConfig`) -- every-step asynchronous checkpoints
  of model, optimizer and data position: a host-memory snapshot, the shard on the local disk and
  a backup on a peer machine outside the rank's parallel groups, sent over TCP; restore from the
  newest step every rank can load (:class:`RestoreResult` says when it fell back);
- :class:`ShadowLoader` (with :class:`ShadowLoaderConfig`) -- a standby DataLoader that takes over a
  hung or dead loader in place, on the same data position.

Importing this module loads the standard library only: each name is imported the first time it is
used, so a script that only reports steps never imports numpy, torch or any of TrainGuard's
services (the worker, the action service, the store).

**Ordering rules** (the only ones):

1. Create the :class:`Reporter` **before** ``torch.distributed.init_process_group``: it turns on
   PyTorch's Flight Recorder through environment variables that the first process group reads.
2. Call ``reporter.step(...)`` after each optimizer step; it never blocks and never raises.
3. Save :meth:`DataPosition.state_dict` in every checkpoint and load it before building the loader.

The lines that protect a ``torchrun`` script (a runnable example: no exporter is needed, the
datagrams are counted as dropped when none listens)::

    >>> import os
    >>> from trainguard.training import Reporter
    >>> reporter = Reporter(
    ...     job=os.environ.get("TRAINGUARD_JOB", "my-job"),
    ...     rank=int(os.environ.get("RANK", "0")),
    ...     socket_path="/nonexistent/reporter.sock",  # omit: $TRAINGUARD_REPORTER_SOCKET or the default
    ...     capture_exceptions=False,  # omit in a real script: uncaught exceptions become exit reasons
    ...     flight_recorder=False,  # omit in a real script (see rule 1)
    ... )
    >>> # torch.distributed.init_process_group(...) comes after the Reporter
    >>> for step in range(1, 3):
    ...     loss = 1.0 / step  # the training step
    ...     reporter.step(step, loss=loss, tokens=4096)
    >>> reporter.close(exit_code=0)

See ``docs/protect-your-job.md`` for the launcher and the services.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainguard.streams.checkpoint import CheckpointConfig, Checkpointer, CheckpointStats, RestoreResult
    from trainguard.streams.data_position import DataPosition, ResumableSampler, SeededSamples
    from trainguard.streams.reporter import Reporter
    from trainguard.streams.shadow_loader import LoaderEvent, ShadowLoader, ShadowLoaderConfig

__all__ = [
    "CheckpointConfig",
    "CheckpointStats",
    "Checkpointer",
    "DataPosition",
    "LoaderEvent",
    "Reporter",
    "RestoreResult",
    "ResumableSampler",
    "SeededSamples",
    "ShadowLoader",
    "ShadowLoaderConfig",
]

#: where each public name lives; imported on first use (PEP 562), so importing this module is cheap.
_HOMES = {
    "Reporter": "trainguard.streams.reporter",
    "DataPosition": "trainguard.streams.data_position",
    "ResumableSampler": "trainguard.streams.data_position",
    "SeededSamples": "trainguard.streams.data_position",
    "ShadowLoader": "trainguard.streams.shadow_loader",
    "ShadowLoaderConfig": "trainguard.streams.shadow_loader",
    "LoaderEvent": "trainguard.streams.shadow_loader",
    "Checkpointer": "trainguard.streams.checkpoint",
    "CheckpointConfig": "trainguard.streams.checkpoint",
    "CheckpointStats": "trainguard.streams.checkpoint",
    "RestoreResult": "trainguard.streams.checkpoint",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
