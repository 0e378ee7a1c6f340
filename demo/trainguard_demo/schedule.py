"""One training step's forward/backward over the pipeline (GPipe: all forwards, then all backwards).

Stage ``s`` receives micro-batch activations from stage ``s-1`` (the first stage embeds tokens),
sends its output to ``s+1``; the last stage computes the loss.  Backward runs in the same
micro-batch order, each stage receiving the gradient of its output from ``s+1`` and sending the
gradient of its input to ``s-1``.  Every pair of neighbours posts sends and receives in the same
order, so the blocking gloo ``send``/``recv`` cannot deadlock.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainguard_demo.model import GPTStage
from trainguard_demo.parallel import ParallelContext, recv, send


def pipeline_step(
    stage: GPTStage,
    ctx: ParallelContext,
    x: torch.Tensor,
    y: torch.Tensor,
    microbatches: int,
    poison: bool,
    lose_sends: bool = False,
) -> float | None:
    """Accumulate this step's gradients on ``stage``; the mean loss on the last stage, else None.

    ``poison`` (the ``nan`` fault) turns this stage's output into NaN, as a corrupted kernel would.
    ``lose_sends`` (the ``hang-p2p`` fault) leaves out this stage's sends -- the forward ones, or
    on the last stage the backward ones: a lost message, so both neighbours block in ``recv``.
    """
    xs, ys = x.chunk(microbatches), y.chunk(microbatches)
    d = stage.cfg.d_model
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    for mb in range(microbatches):
        rows, seq = xs[mb].shape
        # Later stages receive the activation and need its gradient to send back upstream.
        inp = xs[mb] if ctx.is_first_stage else recv((rows, seq, d), ctx.pp_neighbour(-1)).requires_grad_()
        out = stage(inp)
        if poison:
            out = out * float("nan")
        if ctx.is_last_stage:
            out = F.cross_entropy(out.reshape(-1, out.shape[-1]), ys[mb].reshape(-1)) / microbatches
        elif not lose_sends:
            send(out.detach(), ctx.pp_neighbour(+1))
        inputs.append(inp)
        outputs.append(out)
    total = 0.0
    for mb in range(microbatches):
        out, inp = outputs[mb], inputs[mb]
        if ctx.is_last_stage:
            out.backward()
            total += float(out.detach())
        else:
            out.backward(recv(tuple(out.shape), ctx.pp_neighbour(+1)))
        if not ctx.is_first_stage and not (lose_sends and ctx.is_last_stage):
            assert inp.grad is not None
            send(inp.grad, ctx.pp_neighbour(-1))
    return total if ctx.is_last_stage else None
