"""A small pre-norm GPT whose blocks run through the recompute-safe checkpoint wrapper."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import require_bool, require_choice, require_int
from ..errors import ConfigError
from ..nn import Fp4AttentionQuantizer, linear_after
from ..recompute import ENGINES
from .blocks import next_token_loss, run_blocks

__all__ = ["GPT", "GPTConfig"]


@dataclass
class GPTConfig:
    vocab_size: int = 64
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    # activation checkpointing of every block, and through which engine
    checkpoint: bool = True
    checkpoint_engine: str = "torch"  # torch | deepspeed
    use_reentrant: bool = False
    # q and k (and v, if the QuantConfig says so) through a packed-FP4 operand quantizer;
    # head_dim = d_model / n_heads must be a multiple of the FP4 block (16 NVFP4, 32 MXFP4)
    fp4_attention: bool = False

    def __post_init__(self) -> None:
        require_int("vocab_size", self.vocab_size, 2)
        for key in ("seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            require_int(key, getattr(self, key), 1)
        for key in ("checkpoint", "use_reentrant", "fp4_attention"):
            require_bool(key, getattr(self, key))
        require_choice("checkpoint_engine", self.checkpoint_engine, ENGINES)
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not allowed: expected a multiple of n_heads={self.n_heads}")


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, cfg.mlp_ratio * d)
        self.out = nn.Linear(cfg.mlp_ratio * d, d)
        # packed-FP4 attention operands; bound (and named) by Fp8State.convert
        self.attn_quant = Fp4AttentionQuantizer() if cfg.fp4_attention else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # linear_after: the LayerNorm (and below the GELU) fused into an Fp8Linear's input quantize
        q, k, v = linear_after(self.qkv, x, norm=self.ln1).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        if self.attn_quant is not None:  # only the packed codes are saved for backward
            att = self.attn_quant.attention(q, k, v, is_causal=True)
        else:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + linear_after(self.out, linear_after(self.fc, x, norm=self.ln2), activation="gelu")


class GPT(nn.Module):
    """Token embedding + learned positions, ``n_layers`` checkpointed blocks, tied-free head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # what runs the blocks while training, in place of the loop below: e.g. GraphedBlocks
        # (per-block CUDA graphs); None: the loop
        self.blocks_runner = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        if self.blocks_runner is not None and torch.is_grad_enabled():
            return self.head(self.ln(self.blocks_runner(x)))
        return self.head(self.ln(run_blocks(self.blocks, x, self.cfg)))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self(idx), targets)
