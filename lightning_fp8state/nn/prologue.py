"""Prologues: the op that produces an Fp8Linear's input, fused into the input's quantize.

The :class:`Prologue` itself is a stage of the FP8 encoder (:mod:`lightning_fp8state.encoders`);
this module holds the model-facing entry point, :func:`linear_after`.

A pre-norm block feeds ``qkv`` and ``fc`` from a LayerNorm and ``out`` from a GELU. Unfused,
each writes a 16- or 32-bit tensor that the input's quantize reads back; fused, one pass
writes the FP8 codes (and records their amax for the owner). Models ask for it with
:func:`linear_after`, which falls back to the unfused ops for a plain ``nn.Linear``.

What the fused ops compute is in :mod:`lightning_fp8state.ops.reference_fused`: the GELU is
torch's, bit for bit; the LayerNorm has its own reduction order (its float32 output may
differ from ``nn.LayerNorm``'s in the last bits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import require_choice
from ..encoders import ACTIVATIONS, Prologue
from .linear import Fp8Linear

__all__ = ["ACTIVATIONS", "Prologue", "linear_after"]


def _plain_norm(norm: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``norm`` can be folded into the next Linear: an ``nn.LayerNorm`` over the last
    dim with whole parameters and no hooks (ZeRO-3 gathers parameters in hooks: those
    modules run as they are)."""
    if type(norm) is not nn.LayerNorm:
        return False
    width = (x.shape[-1],)
    if tuple(norm.normalized_shape) != width or norm._forward_hooks or norm._forward_pre_hooks:
        return False
    weight, bias = norm.weight, norm.bias
    return (weight is None or weight.shape == width) and (bias is None or bias.shape == width)


def linear_after(linear: nn.Module, x: torch.Tensor, *, norm: nn.Module | None = None, activation: str | None = None):
    """``linear(activation(norm(x)))``, with the norm or the activation fused into an
    :class:`~lightning_fp8state.nn.Fp8Linear`'s input quantize where it can be.

    Either ``norm`` (a module applied to ``x``) or ``activation`` (one of ``ACTIVATIONS``),
    not both. Any other Linear gets the plain composition.
    """
    if norm is not None:
        require_choice("activation", activation, (None,), why="linear_after takes norm or activation, not both")
    elif activation is not None:
        require_choice("activation", activation, ACTIVATIONS)
    if isinstance(linear, Fp8Linear):
        if norm is not None and _plain_norm(norm, x):
            return linear(x, prologue="layer_norm", norm=norm)
        if activation is not None:
            return linear(x, prologue=activation)
    if norm is not None:
        x = norm(x)
    if activation is not None:
        x = F.gelu(x)
    return linear(x)
