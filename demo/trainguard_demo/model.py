"""A tiny char-level GPT, cut into pipeline stages whose attention and MLP are tensor-parallel.

Stage ``s`` of ``pp`` holds blocks ``[s*L/pp, (s+1)*L/pp)``; the first stage also holds the
token and position embeddings, the last the final LayerNorm and the LM head.  Inside a block the
heads are split across TP ranks (column-parallel q/k/v, row-parallel output projection) and so is
the MLP's hidden layer (column-parallel up, row-parallel down), so a block costs two all-reduces
in the TP group forward and two backward.  Embeddings, LayerNorms and the head are replicated.

The MLP activation is the job's "user code" (:mod:`.codever`), swapped in place on a hot update;
``before_block`` is where fault hooks run inside the forward (a hang there leaves a stack that
points into the model, as a stuck kernel would).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainguard_demo.config import ModelConfig
from trainguard_demo.parallel import ColumnParallelLinear, ParallelContext, RowParallelLinear

Activation = Callable[[torch.Tensor], torch.Tensor]


class Block(nn.Module):
    """Pre-LN transformer block with this TP rank's share of the heads and MLP units."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, seed: int, act: Activation) -> None:
        super().__init__()
        tp, r, g = ctx.topology.tp, ctx.tp_rank, ctx.tp_group
        d = cfg.d_model
        self.local_heads = cfg.n_heads // tp
        self.head_dim = d // cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.q = ColumnParallelLinear(d, d, tp, r, g, seed + 1)
        self.k = ColumnParallelLinear(d, d, tp, r, g, seed + 2)
        self.v = ColumnParallelLinear(d, d, tp, r, g, seed + 3)
        self.proj = RowParallelLinear(d, d, tp, r, g, seed + 4)
        self.ln2 = nn.LayerNorm(d)
        self.up = ColumnParallelLinear(d, cfg.d_ff, tp, r, g, seed + 5)
        self.down = RowParallelLinear(cfg.d_ff, d, tp, r, g, seed + 6)
        self.act = act

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.local_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        q, k, v = self._heads(self.q(h)), self._heads(self.k(h)), self._heads(self.v(h))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        b, _, t, _ = a.shape
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(self.act(self.up(self.ln2(x))))


class GPTStage(nn.Module):
    """This rank's pipeline stage: tokens (first stage) or activations in, activations or logits out."""

    def __init__(
        self, cfg: ModelConfig, vocab: int, ctx: ParallelContext, seed: int, act: Activation
    ) -> None:
        super().__init__()
        per_stage = cfg.n_layers // ctx.topology.pp
        first_layer = ctx.coords.pp * per_stage
        # Replicated parameters come from the global RNG: the same seed on every TP rank of a
        # stage makes them identical there, as Megatron requires.
        torch.manual_seed(seed + 7919 * ctx.coords.pp)
        self.cfg = cfg
        self.is_first, self.is_last = ctx.is_first_stage, ctx.is_last_stage
        if self.is_first:
            self.tok = nn.Embedding(vocab, cfg.d_model)
            self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(
            Block(cfg, ctx, seed + 100 * (first_layer + i), act) for i in range(per_stage)
        )
        if self.is_last:
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, vocab)
        #: called before every block's forward (fault hooks: hang, slow, oom).
        self.before_block: Callable[[], None] | None = None

    def set_activation(self, act: Activation) -> None:
        """Hot update of the user code: every block uses ``act`` from the next forward on."""
        for blk in self.blocks:
            blk.act = act  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            positions = torch.arange(x.shape[1])
            x = self.tok(x) + self.pos(positions)
        for blk in self.blocks:
            if self.before_block is not None:
                self.before_block()
            x = blk(x)
        if self.is_last:
            x = self.head(self.ln_f(x))
        return x
