"""One rank of the demo job: rendezvous, groups, resume, the step loop, checkpoints, faults, telemetry.

``python -m trainguard_demo.trainer --cluster-dir D --job J --rank R --tp 2 --pp 2 --dp 2
--ranks-per-machine 2 --machines m0,m1,m2,m3 --master-port 29600 --steps 100 [--resume]``
(:meth:`LaunchSpec.to_argv` writes the full flag list; :mod:`.launcher` starts every rank).

Per step the rank takes its batch from its DataLoader (:mod:`.data`: a shuffled share of the
corpus per DP replica, through the shadow loader unless ``--no-shadow-loader``), polls its
machine's faults and the code version (in-place hot update), runs the pipeline schedule, averages
gradients over DP, clips by the global norm, steps AdamW (with ``--nan-check``, a non-finite loss
then raises ``FloatingPointError``), hands a snapshot with the data position to the checkpoint
writer every ``--checkpoint-every`` steps (default 1: every step), reports ``loss``/``grad_norm``/
``tokens``/``data_wait_s`` through :class:`trainguard.training.Reporter` and rewrites its progress file
``machines/<m>/run/<job>/rank-R.json`` (``step``, ``loss``, ``ts``, ``status`` ...), whose stale
``ts`` is what a hang looks like from outside.  Failures raise: the traceback goes to stderr and
the exit code is 1 (or the signal's, for ``crash`` with a signal).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from trainguard.streams.data_position import DataPosition, ResumableSampler
from trainguard.streams.reporter import Reporter
from trainguard.streams.shadow_loader import LoaderEvent, ShadowLoader
from trainguard_demo.checkpoint import CheckpointWriter, latest_complete, load_shard, snapshot
from trainguard_demo.codever import CodeWatcher
from trainguard_demo.config import LaunchSpec, ModelConfig, write_atomic
from trainguard_demo.corpus import VOCAB
from trainguard_demo.data import LOADER_ARGS, CorpusWindows, plain_batches
from trainguard_demo.faults import FaultPoller, hang_forever
from trainguard_demo.model import GPTStage
from trainguard_demo.parallel import (
    ParallelContext,
    allreduce_dp_grads,
    build_groups,
    global_grad_norm,
    init_distributed,
)
from trainguard_demo.schedule import pipeline_step

OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of "
    "which 1.06 GiB is free. Of the allocated memory 74.31 GiB is allocated by PyTorch."
)


class Progress:
    """The rank's per-step heartbeat file (atomically replaced, read by the demo's live view)."""

    def __init__(self, spec: LaunchSpec, rank: int) -> None:
        self.path = spec.paths().progress(spec.machine_of_rank(rank), spec.job, rank)
        self.fields: dict[str, Any] = {
            "job": spec.job, "rank": rank, "machine": spec.machine_of_rank(rank), "pid": os.getpid(),
        }  # fmt: skip

    def write(self, status: str, **fields: Any) -> None:
        """Update the record (fields not given keep their last value, e.g. the step of a failure)."""
        self.fields.update(fields, status=status, ts=time.time())
        write_atomic(self.path, json.dumps(self.fields))


#: nominal FP32 FLOP/s of one rank's share of a CPU core (MFU's denominator; see run_rank).
NOMINAL_PEAK_FLOPS = 1e9


def _fault_hook(hang: bool, oom: bool) -> Callable[[], None] | None:
    if not (hang or oom):
        return None

    def hook() -> None:
        if hang:
            hang_forever("compute")
        raise torch.OutOfMemoryError(OOM_MESSAGE)

    return hook


def _crash(rank: int, step: int, signame: str) -> None:
    if signame:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.Signals[signame if signame.startswith("SIG") else f"SIG{signame}"])
    raise RuntimeError(f"injected crash on rank {rank} at step {step}")


def _resume(
    spec: LaunchSpec, rank: int, stage: GPTStage, optim: torch.optim.Optimizer, position: DataPosition
) -> tuple[int, str]:
    """Load the latest step complete on every rank's view, with its data position; (0, "") when
    there is none."""
    found = latest_complete(spec)
    # Ranks agree on the step (min over ranks), so a shard finishing mid-scan cannot split them.
    agreed = torch.tensor([found[0] if found else 0])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    step = int(agreed)
    if step == 0:
        return 0, ""
    at = latest_complete(spec, at_most=step)
    assert at is not None and at[0] == step, f"step {step} is no longer complete"
    state = load_shard(at[1][rank])
    stage.load_state_dict(state["model"])
    optim.load_state_dict(state["optim"])
    position.load_state_dict(state["data_position"])
    return step, str(state["loaded_from"])


def _batch_digest(x: torch.Tensor, y: torch.Tensor) -> str:
    return hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()[:16]


def _share_loss(loss: float | None, ctx: ParallelContext) -> float:
    """The pipeline's loss on every stage (only the last computes it)."""
    t = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64)
    if ctx.pp_group is not None:
        dist.all_reduce(t, group=ctx.pp_group)
    return float(t)


def prewarm() -> None:
    """Pay the lazy first-use costs of a rank before it is needed (a warm pool calls this while
    it waits): the first optimizer imports ``torch._dynamo`` (about 1 s alone, 5 s with eight
    ranks starting on two cores), the first save/load sets up serialization."""
    import io

    torch.set_num_threads(1)
    layer = torch.nn.Linear(4, 4)
    optim = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    layer(torch.ones(2, 4)).sum().backward()
    optim.step()
    buf = io.BytesIO()
    torch.save({"model": layer.state_dict(), "optim": optim.state_dict()}, buf)
    torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def run_rank(spec: LaunchSpec, rank: int) -> int:
    """Train ``rank`` of ``spec`` to ``spec.steps``; returns 0 (errors raise)."""
    torch.set_num_threads(1)  # 8 ranks share 2 cores: intra-op threads would only thrash
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: rendezvous over loopback
    machine = spec.machine_of_rank(rank)
    local_rank = rank % spec.ranks_per_machine
    progress = Progress(spec, rank)
    progress.write("starting", step=0)
    rep = Reporter(job=spec.job, rank=rank, node=machine, socket_path=spec.reporter_socket or None)
    faults = FaultPoller(spec.cluster_dir, machine, spec.job, rank, local_rank)
    code = CodeWatcher(spec.cluster_dir)
    topo = spec.topology()
    try:
        t0 = time.perf_counter()
        marks: list[tuple[str, float]] = []
        init_distributed(topo, rank, spec.master_addr, spec.master_port, spec.pg_timeout_s)
        marks.append(("rendezvous", time.perf_counter()))
        ctx = build_groups(topo, rank)
        marks.append(("groups", time.perf_counter()))
        stage = GPTStage(spec.model, len(VOCAB), ctx, spec.seed, code.module.activation)
        optim = torch.optim.AdamW(stage.parameters(), lr=spec.lr, weight_decay=0.0)
        marks.append(("model", time.perf_counter()))
        # Every rank of a DP replica reads the replica's share of each shuffled epoch.
        data = CorpusWindows(
            spec.model.seq_len, FaultPoller(spec.cluster_dir, machine, spec.job, rank, local_rank)
        )
        position = DataPosition(
            ResumableSampler(len(data), seed=spec.seed, rank=ctx.coords.dp, world_size=spec.dp),
            torch.Generator(),
        )
        start, loaded_from = _resume(spec, rank, stage, optim, position) if spec.resume else (0, "")
        marks.append(("resume", time.perf_counter()))
        if start:
            print(f"rank {rank}: resumed at step {start} from {loaded_from} at data epoch "
                  f"{position.sampler.epoch} sample {position.sampler.offset}", flush=True)  # fmt: skip
        writer = CheckpointWriter(spec, rank, code.version)
        rows = spec.micro_batch * spec.microbatches
        shadow: ShadowLoader | None = None
        if spec.shadow_loader:

            def on_loader_event(event: LoaderEvent) -> None:
                print(f"rank {rank}: {event.line()}", flush=True)
                rep.log(event.line())

            loader_args = {"batch_size": rows, "num_workers": spec.data_workers, **LOADER_ARGS}
            shadow = ShadowLoader(data, position, loader_args, on_event=on_loader_event)
            batches = shadow.batches()
        else:
            batches = plain_batches(data, position, rows, spec.data_workers)
        batch_log = open(f"{spec.batch_log}.rank-{rank}", "a") if spec.batch_log else None  # noqa: SIM115
        # Where a (re)start spends its time: the restart cost is what ETTR loses per incident.
        starts = [t0] + [t for _, t in marks[:-1]]
        phases = ", ".join(f"{n} {t - p:.2f}s" for (n, t), p in zip(marks, starts, strict=True))
        print(f"rank {rank}: started in {marks[-1][1] - t0:.2f}s ({phases})", flush=True)
        tokens = spec.micro_batch * spec.microbatches * spec.model.seq_len
        # MFU = model FLOPs per second / peak: 6 FLOPs per parameter per token (forward and
        # backward), over a nominal per-rank CPU peak -- the demo's MFU is relative, which is all
        # the MFU-decline detector needs to see a fail-slow rank pull the whole job down.
        rep.flops_per_step = 6.0 * sum(p.numel() for p in stage.parameters()) * tokens
        rep.peak_flops = NOMINAL_PEAK_FLOPS
        # The rank's normal step time, the unit of the slow fault: the median of its last 200
        # healthy steps (about a minute).  An average of the last few made the "4x slower" rank
        # anything from 2x to 5x slower on this busy host; the median of the last 50 still caught
        # a fast spell (0.2 s steps against a usual 0.3 s): the rank was 2.8x slower, the job's
        # MFU fell to 0.37 of its 400-step baseline, just above the detector's 0.35, and the slow
        # rank was never found (a demo run at 536796a).
        recent_steps: collections.deque[float] = collections.deque(maxlen=200)
        t_prev = time.perf_counter()
        for step in range(start + 1, spec.steps + 1):
            t_wait = time.perf_counter()
            xs, ys = next(batches)  # blocks while the loader has no batch ready
            data_wait_s = time.perf_counter() - t_wait
            x, y = torch.from_numpy(xs), torch.from_numpy(ys)
            if batch_log is not None:
                batch_log.write(f"{step} {_batch_digest(x, y)}\n")
                batch_log.flush()
            faults.poll()
            if code.poll():
                stage.set_activation(code.module.activation)
                writer.code_version = code.version
                print(f"rank {rank}: hot update to code version {code.version} at step {step}", flush=True)
            if crash := faults.active("crash", step):
                _crash(rank, step, crash.signal)
            stage.before_block = _fault_hook(
                faults.active("hang", step) is not None, faults.active("oom", step) is not None
            )
            loss = pipeline_step(
                stage, ctx, x, y, spec.microbatches,
                poison=faults.active("nan", step) is not None,
                lose_sends=faults.active("hang-p2p", step) is not None,
            )  # fmt: skip
            if (slow := faults.active("slow", step)) and recent_steps:
                time.sleep((slow.factor - 1) * statistics.median(recent_steps))
            allreduce_dp_grads(stage, ctx)
            grad_norm = float(global_grad_norm(stage, ctx))
            if grad_norm > spec.clip_norm:  # NaN compares False: NaN grads pass through, as on a GPU
                for p in stage.parameters():
                    if p.grad is not None:
                        p.grad.mul_(spec.clip_norm / grad_norm)
            optim.step()
            optim.zero_grad(set_to_none=True)
            shared_loss = _share_loss(loss, ctx)
            if spec.nan_check and not math.isfinite(shared_loss):
                raise FloatingPointError(f"non-finite loss {shared_loss} at step {step}")
            hang_ckpt = faults.active("hang-checkpoint", step) is not None
            # A non-finite loss means non-finite weights from here on: never make them the latest
            # complete checkpoint, so a reattempt resumes from the last healthy step.
            finite = math.isfinite(shared_loss)
            waited = 0.0
            if finite and step % spec.checkpoint_every == 0:  # periodic: 1 = every step
                state = snapshot(stage, optim, step=step, data_position=position.state_dict())
                waited = writer.submit(step, state, hang=hang_ckpt)
            now = time.perf_counter()
            step_s, t_prev = now - t_prev, now
            if not slow:
                recent_steps.append(step_s)
            rep.step(step, loss=shared_loss, grad_norm=grad_norm, tokens=tokens, step_time_s=step_s,
                     data_wait_s=data_wait_s)  # fmt: skip
            progress.write("running", step=step, loss=shared_loss, grad_norm=grad_norm, step_time_s=step_s,
                           ckpt_wait_s=waited, ckpt_step=writer.last_written, code_version=code.version,
                           resumed_from=start, data_wait_s=data_wait_s,
                           loader_takeovers=len(shadow.events) if shadow else 0)  # fmt: skip
            print(f"rank {rank} step {step} loss {shared_loss:.4f} grad_norm {grad_norm:.3f} "
                  f"step_time {step_s:.3f}s", flush=True)  # fmt: skip
            if spec.step_delay_s:
                time.sleep(spec.step_delay_s)
        writer.wait()
        if shadow is not None:
            shadow.close()
        if batch_log is not None:
            batch_log.close()
        progress.write("done", step=spec.steps, ckpt_step=writer.last_written)
        rep.close(exit_code=0)
        dist.destroy_process_group()
        return 0
    except BaseException as exc:
        progress.write("failed", error=f"{type(exc).__name__}: {exc}"[:500])
        raise


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainguard_demo.trainer", description="one rank of the demo job"
    )
    p.add_argument("--cluster-dir", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, help="checked against tp*pp*dp")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--ranks-per-machine", type=int, default=1)
    p.add_argument("--machines", default="", help="comma-separated machine names, machine 0 first")
    p.add_argument("--machine", default="", help="this rank's machine (checked against --machines)")
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29600)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--keep-checkpoints", type=int, default=3)
    p.add_argument("--checkpoint-every", type=int, default=1, help="checkpoint every N steps")
    p.add_argument("--nan-check", action=argparse.BooleanOptionalAction, default=False,
                   help="raise FloatingPointError on a non-finite loss")  # fmt: skip
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--shadow-loader", action=argparse.BooleanOptionalAction, default=True,
                   help="a standby loader takes over a hung one (trainguard.training)")  # fmt: skip
    p.add_argument("--data-workers", type=int, default=1, help="DataLoader worker processes per loader")
    p.add_argument("--batch-log", default="", help="append 'step sha256' per step to PATH.rank-R")
    p.add_argument("--pg-timeout", type=float, default=600.0)
    p.add_argument("--reporter-socket", default="")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-ff", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=32)
    return p


def spec_from_args(a: argparse.Namespace) -> tuple[LaunchSpec, int]:
    spec = LaunchSpec(
        job=a.job, cluster_dir=a.cluster_dir, tp=a.tp, pp=a.pp, dp=a.dp,
        ranks_per_machine=a.ranks_per_machine, machines=[m for m in a.machines.split(",") if m],
        steps=a.steps, master_addr=a.master_addr,
        master_port=a.master_port, resume=a.resume, micro_batch=a.micro_batch, microbatches=a.microbatches,
        lr=a.lr, clip_norm=a.clip_norm, seed=a.seed, keep_checkpoints=a.keep_checkpoints,
        checkpoint_every=a.checkpoint_every, nan_check=a.nan_check,
        step_delay_s=a.step_delay, pg_timeout_s=a.pg_timeout, reporter_socket=a.reporter_socket,
        shadow_loader=a.shadow_loader, data_workers=a.data_workers, batch_log=a.batch_log,
        model=ModelConfig(
            d_model=a.d_model, n_heads=a.heads, n_layers=a.layers, d_ff=a.d_ff, seq_len=a.seq_len
        ),
    )  # fmt: skip
    if a.world_size is not None and a.world_size != spec.world_size:
        raise SystemExit(f"--world-size {a.world_size} != tp*pp*dp = {spec.world_size}")
    if not 0 <= a.rank < spec.world_size:
        raise SystemExit(f"--rank {a.rank} outside 0..{spec.world_size - 1}")
    if a.machine and a.machine != spec.machine_of_rank(a.rank):
        raise SystemExit(f"--machine {a.machine} but rank {a.rank} is on {spec.machine_of_rank(a.rank)}")
    return spec, a.rank


def main(argv: list[str] | None = None) -> int:
    spec, rank = spec_from_args(build_parser().parse_args(argv))
    return run_rank(spec, rank)


if __name__ == "__main__":
    sys.exit(main())
