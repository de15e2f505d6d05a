"""What the bundled language models share: their stack of blocks run through the recompute-safe
checkpoint wrapper, and their next-token loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..recompute import checkpoint

__all__ = ["next_token_loss", "run_blocks"]


def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, cfg) -> torch.Tensor:
    """``x`` through ``blocks`` in order; while training with ``cfg.checkpoint``, each block as a
    checkpoint region of ``cfg.checkpoint_engine`` (``cfg.use_reentrant`` for torch's)."""
    for block in blocks:
        if cfg.checkpoint and torch.is_grad_enabled():
            kw = {"use_reentrant": cfg.use_reentrant} if cfg.checkpoint_engine == "torch" else {}
            x = checkpoint(block, x, engine=cfg.checkpoint_engine, **kw)
        else:
            x = block(x)
    return x


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits [B, T, V]`` against ``targets [B, T]``, in float32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
