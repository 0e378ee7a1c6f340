"""Every-step asynchronous checkpoints on local disk with a cross-parallel-group backup (§6.3).

After step ``S`` a rank snapshots its model and optimizer state (a CPU copy: the next step
mutates them) and hands it to a writer thread, which serialises it and writes

* its own shard ``<own machine>/ckpt/<job>/step-S/rank-R.pt`` and
* a backup ``<peer machine>/ckpt/<job>/backup/step-S/rank-R.pt``, where the peer machine shares
  no TP, PP or DP group with this machine (:func:`trainguard.detectors.planning.machine_backup_peers`), so
  over-evicting a whole parallel group never takes a shard and its backup together.

Each ``.pt`` is written under a temp name and renamed, then a small manifest ``rank-R.json``
(step, rank, layout, size, sha256) is written the same way: the manifest's presence is what makes
a shard complete.  The training loop waits only if it requests a new write while the previous
one still runs.  :func:`latest_complete` finds the highest step for which every rank has a
complete shard or backup on the job's current machines (an evicted machine's disk is gone).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from trainguard.detectors.planning import PlanningError, machine_backup_peers
from trainguard_demo.config import LaunchSpec, write_atomic
from trainguard_demo.faults import hang_forever


@dataclass(frozen=True)
class ShardManifest:
    """What a shard holds; written after the shard, so a present manifest means a complete shard."""

    job: str
    step: int
    rank: int
    tp: int
    pp: int
    dp: int
    size: int
    sha256: str
    machine: str
    code_version: str


def backup_machine(spec: LaunchSpec, machine: str) -> str | None:
    """The machine that holds ``machine``'s backups: one sharing no parallel group with it, else
    (layouts with one real parallel dimension, as the paper's pure-ZeRO case) the next machine;
    None for a one-machine job."""
    names = spec.machine_names()
    i = names.index(machine)
    try:
        return names[machine_backup_peers(spec.topology())[i]]
    except PlanningError:
        return names[(i + 1) % len(names)] if len(names) > 1 else None


def snapshot(model: torch.nn.Module, optim: torch.optim.Optimizer, **extra: Any) -> dict[str, Any]:
    """A private CPU copy of the training state (on a GPU this is the D2H copy)."""
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optim": copy.deepcopy(optim.state_dict()),
        **extra,
    }


class CheckpointWriter:
    """Writes one rank's shard and backup per step in a background thread."""

    def __init__(self, spec: LaunchSpec, rank: int, code_version: str = "") -> None:
        self.spec, self.rank = spec, rank
        self.machine = spec.machine_of_rank(rank)
        self.peer = backup_machine(spec, self.machine)
        self.paths = spec.paths()
        self.code_version = code_version
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        #: seconds the loop spent waiting for the previous write, summed (0 when I/O keeps up).
        self.waited_s = 0.0
        self.last_written = 0

    def submit(self, step: int, state: dict[str, Any], hang: bool = False) -> float:
        """Start writing ``state`` as step ``step``; returns the seconds spent waiting first."""
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        self.waited_s += waited
        self._thread = threading.Thread(
            target=self._run, args=(step, state, hang), name=f"checkpoint-writer-{step}", daemon=True
        )
        self._thread.start()
        return waited

    def wait(self) -> None:
        """Block until the running write is done; re-raises its error (a failed save is fatal)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"checkpoint write failed on rank {self.rank}") from err

    def _targets(self) -> list[tuple[str, bool]]:
        """(machine, is_backup) pairs a shard goes to: own disk first, then the peer's."""
        return [(self.machine, False)] + ([(self.peer, True)] if self.peer else [])

    def _run(self, step: int, state: dict[str, Any], hang: bool) -> None:
        try:
            if hang:
                hang_forever("checkpoint")
            buf = io.BytesIO()
            torch.save(state, buf)
            data = buf.getvalue()
            s = self.spec
            manifest = ShardManifest(
                job=s.job, step=step, rank=self.rank, tp=s.tp, pp=s.pp, dp=s.dp, size=len(data),
                sha256=hashlib.sha256(data).hexdigest(), machine=self.machine, code_version=self.code_version,
            )  # fmt: skip
            for machine, backup in self._targets():
                d = self.paths.ckpt_step(machine, s.job, step, backup=backup)
                # A manifest left by an earlier run of this step must not vouch for the new bytes.
                (d / f"rank-{self.rank:05d}.json").unlink(missing_ok=True)
                write_atomic(d / f"rank-{self.rank:05d}.pt", data)
                write_atomic(d / f"rank-{self.rank:05d}.json", json.dumps(asdict(manifest)))
            self.last_written = step
            self._prune(step)
        except BaseException as exc:  # surfaced to the training loop by wait()
            self._error = exc

    def _prune(self, step: int) -> None:
        """Drop this rank's shards older than the newest ``keep_checkpoints`` checkpoints."""
        # In checkpoints, not steps: with periodic checkpoints a rank that wrote step S must keep
        # S - every, which is the latest complete step while a peer is still writing (or died in) S.
        horizon = step - self.spec.keep_checkpoints * self.spec.checkpoint_every
        for machine, backup in self._targets():
            root = self.paths.ckpt_root(machine, self.spec.job, backup=backup)
            for d in root.glob("step-*"):
                if int(d.name[5:]) > horizon:
                    continue
                for f in d.glob(f"rank-{self.rank:05d}.*"):
                    f.unlink(missing_ok=True)
                # Ranks sharing a backup peer prune the same step folder concurrently.
                with contextlib.suppress(FileNotFoundError):
                    if not any(d.iterdir()):
                        shutil.rmtree(d, ignore_errors=True)


def _manifests(spec: LaunchSpec) -> dict[int, dict[int, list[Path]]]:
    """step -> rank -> complete shard files on the job's machines (own machine's copy first)."""
    found: dict[int, dict[int, list[tuple[bool, bool, Path]]]] = {}
    for machine in spec.machine_names():
        for backup in (False, True):
            root = spec.paths().ckpt_root(machine, spec.job, backup=backup)
            for mf in root.glob("step-*/rank-*.json"):
                try:
                    m = ShardManifest(**json.loads(mf.read_text()))
                    pt = mf.with_suffix(".pt")
                    ok = (m.tp, m.pp, m.dp) == (spec.tp, spec.pp, spec.dp) and pt.stat().st_size == m.size
                except (OSError, ValueError, TypeError):
                    continue  # torn, foreign or being pruned: not a complete shard
                if ok and m.rank < spec.world_size:
                    own = machine == spec.machine_of_rank(m.rank)
                    found.setdefault(m.step, {}).setdefault(m.rank, []).append((not own, backup, pt))
    return {
        step: {rank: [pt for *_, pt in sorted(c)] for rank, c in ranks.items()}
        for step, ranks in found.items()
    }


def latest_complete(spec: LaunchSpec, at_most: int | None = None) -> tuple[int, dict[int, list[Path]]] | None:
    """The highest step (``<= at_most``) with a complete shard or backup for every rank, and
    rank -> its candidate files (own machine's copy first)."""
    for step, ranks in sorted(_manifests(spec).items(), reverse=True):
        if len(ranks) == spec.world_size and (at_most is None or step <= at_most):
            return step, ranks
    return None


def load_shard(files: list[Path]) -> dict[str, Any]:
    """Load the first candidate whose bytes match its manifest's sha256 (own copy, then backup)."""
    errors = []
    for pt in files:
        try:
            data = pt.read_bytes()
            m = json.loads(pt.with_suffix(".json").read_text())
            if hashlib.sha256(data).hexdigest() != m["sha256"]:
                errors.append(f"{pt}: sha256 mismatch")
                continue
            state: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
            state["loaded_from"] = str(pt)
            return state
        except (OSError, ValueError, KeyError) as exc:
            errors.append(f"{pt}: {exc}")
    raise RuntimeError("no usable copy of the shard: " + "; ".join(errors))
