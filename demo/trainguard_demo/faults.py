"""Fault hooks: ``<cluster_dir>/machines/<m>/faults.json``, polled by the machine's ranks every step.

:func:`inject_fault` appends a :class:`Fault`; each rank's :class:`FaultPoller` re-reads the file
when it changes (one ``stat`` per step) and reports which faults are active at a step.  Kinds:

==================  ===========================================================================
``hang``            the rank sleeps forever inside the model forward (stuck kernel)
``hang-dataloader`` the rank's DataLoader worker blocks; the main process waits on it forever
                    (or, with the shadow loader, its standby loader takes over)
``hang-checkpoint`` the rank's checkpoint writer blocks; the next step waits for it forever
``hang-p2p``        the rank's pipeline sends are lost: its next stage (or, from the last stage,
                    its previous one) waits in ``recv`` forever, and so does the rank itself
``slow``            the rank's steps take ``factor`` times as long (a fail-slow GPU)
``nan``             the rank's stage output becomes NaN (loss NaN, then spreads through DP)
``crash``           the rank raises ``RuntimeError`` (exit 1), or dies by ``signal`` if given
``oom``             the rank raises ``torch.OutOfMemoryError: CUDA out of memory ...``
``user-error``      not per machine: switches the job's code to ``v2-buggy`` (a ``TypeError`` in
                    the MLP on every rank); :func:`trainguard_demo.codever.rollback` undoes it
==================  ===========================================================================

A fault fires from ``at_step`` on (0: the next step) on one rank of the machine
(``local_rank``, default 0) or all (``local_rank=None``).  It is **one-shot** unless
``persistent``: the rank writes ``faults.fired/<id>.rank-<R>`` when it fires, and a restarted
process ignores fired faults -- a reattempt on the same machine then succeeds (a transient fault),
while a persistent one hits again (a broken machine that must be evicted).

CLI: ``python -m trainguard_demo.faults --cluster-dir D --machine M --fault KIND [--job J]
[--at-step S] [--local-rank R|all] [--factor K] [--signal SIGSEGV] [--persistent]``, or
``--clear``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainguard_demo import codever
from trainguard_demo.config import ClusterPaths, write_atomic

KINDS = (
    "hang", "hang-dataloader", "hang-checkpoint", "hang-p2p", "slow", "nan", "crash", "oom", "user-error",
)  # fmt: skip


@dataclass(frozen=True)
class Fault:
    """One injected fault (see the module docstring for the kinds)."""

    kind: str
    #: only ranks of this job react; empty = any job on the machine.
    job: str = ""
    #: index of the rank on its machine; None = every rank of the machine.
    local_rank: int | None = 0
    #: first step at which it is active; 0 = the next step the rank runs.
    at_step: int = 0
    #: ``slow``: how many times longer each step takes.
    factor: float = 4.0
    #: ``crash``: a signal name (SIGSEGV, SIGABRT, SIGKILL) to die by instead of raising.
    signal: str = ""
    persistent: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; known: {', '.join(KINDS)}")
        if self.factor < 1:
            raise ValueError(f"slow factor {self.factor} must be >= 1")


def read_faults(cluster_dir: str | os.PathLike[str], machine: str) -> list[Fault]:
    path = ClusterPaths(Path(cluster_dir)).faults(machine)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    return [Fault(**f) for f in raw]


def inject_fault(cluster_dir: str | os.PathLike[str], machine: str, kind: str, **kwargs: object) -> Fault:
    """Add a fault for ``machine`` (``user-error`` switches the job's code version instead)."""
    fault = Fault(kind=kind, **kwargs)  # type: ignore[arg-type]
    if kind == "user-error":
        codever.set_version(cluster_dir, "v2-buggy")
        return fault
    faults = [*read_faults(cluster_dir, machine), fault]
    path = ClusterPaths(Path(cluster_dir)).faults(machine)
    write_atomic(path, json.dumps([asdict(f) for f in faults], indent=1))
    return fault


def clear_faults(cluster_dir: str | os.PathLike[str], machine: str) -> None:
    """Remove the machine's faults (fired markers stay: they only matter while a fault is listed)."""
    path = ClusterPaths(Path(cluster_dir)).faults(machine)
    path.unlink(missing_ok=True)


class FaultPoller:
    """A rank's view of its machine's faults; :meth:`poll` once per step, then :meth:`active`."""

    def __init__(
        self, cluster_dir: str | os.PathLike[str], machine: str, job: str, rank: int, local_rank: int
    ):
        self.paths = ClusterPaths(Path(cluster_dir))
        self.cluster_dir, self.machine, self.job = cluster_dir, machine, job
        self.rank, self.local_rank = rank, local_rank
        self._stamp: tuple[int, int] | None = None
        self._faults: list[Fault] = []
        self._fired_here: set[str] = set()

    def _marker(self, fault: Fault) -> Path:
        return self.paths.machine(self.machine) / "faults.fired" / f"{fault.id}.rank-{self.rank}"

    def _mine(self, f: Fault) -> bool:
        if f.job and f.job != self.job:
            return False
        if f.local_rank is not None and f.local_rank != self.local_rank:
            return False
        # One-shot faults that fired in an earlier process of this rank are spent.
        return f.persistent or f.id in self._fired_here or not self._marker(f).exists()

    def poll(self) -> None:
        path = self.paths.faults(self.machine)
        try:
            st = path.stat()
            stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_ino)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return
        self._stamp = stamp
        self._faults = [f for f in read_faults(self.cluster_dir, self.machine) if self._mine(f)]

    def active(self, kind: str, step: int | None) -> Fault | None:
        """The first fault of ``kind`` active at ``step`` (None: whatever the step); marks it
        fired (and says so on stdout)."""
        for f in self._faults:
            if f.kind == kind and (step is None or step >= f.at_step):
                if f.id not in self._fired_here:
                    self._fired_here.add(f.id)
                    write_atomic(self._marker(f), f"{step}\n")
                    when = "in its data loader" if step is None else f"at step {step}"
                    msg = f"trainguard-demo: fault {f.kind} ({f.id}) fires on rank {self.rank} {when}"
                    print(msg, flush=True)
                return f
        return None

    def active_now(self, kind: str) -> Fault | None:
        """The first fault of ``kind`` active whatever the step (a loader worker knows samples,
        not steps); marks it fired like :meth:`active`."""
        return self.active(kind, None)


def hang_forever(where: str) -> None:
    """Block like a stuck kernel / worker / writer: sleep (no CPU burnt on a 2-core host)."""
    while True:  # the process is killed from outside; nothing here ends the hang
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainguard_demo.faults", description=__doc__.split("\n")[0])
    p.add_argument("--cluster-dir", required=True)
    p.add_argument("--machine", required=True)
    p.add_argument("--fault", choices=KINDS)
    p.add_argument("--job", default="")
    p.add_argument("--at-step", type=int, default=0)
    p.add_argument("--local-rank", default="0", help="index of the rank on the machine, or 'all'")
    p.add_argument("--factor", type=float, default=4.0)
    p.add_argument("--signal", default="")
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--clear", action="store_true", help="remove the machine's faults")
    a = p.parse_args(argv)
    if a.clear:
        clear_faults(a.cluster_dir, a.machine)
        return 0
    if not a.fault:
        p.error("--fault or --clear is required")
    fault = inject_fault(
        a.cluster_dir,
        a.machine,
        a.fault,
        job=a.job,
        at_step=a.at_step,
        local_rank=None if a.local_rank == "all" else int(a.local_rank),
        factor=a.factor,
        signal=a.signal,
        persistent=a.persistent,
    )
    print(json.dumps(asdict(fault)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
