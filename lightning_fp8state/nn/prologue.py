"""Prologues: the op that produces an Fp8Linear's input, fused into the input's quantize.

The :class:`Prologue` itself is a stage of the FP8 encoder (:mod:`lightning_fp8state.encoders`);
this module holds the model-facing entry point, :func:`linear_after`.

A pre-norm block feeds ``qkv`` and ``fc`` from a LayerNorm and ``out`` from a GELU; a Llama
block feeds ``q/k/v`` and ``gate/up`` from an RMSNorm and ``down`` from a SwiGLU (of a fused
``gate_up`` projection's output). Unfused, each writes a 16- or 32-bit tensor that the input's
quantize reads back; fused, one pass writes the FP8 codes (and records their amax for the
owner). Models ask for it with :func:`linear_after`, which falls back to the unfused ops for a
plain ``nn.Linear``.

What the fused ops compute is in :mod:`lightning_fp8state.ops.reference_fused` (LayerNorm,
GELU), :mod:`~lightning_fp8state.ops.reference_rms` and
:mod:`~lightning_fp8state.ops.reference_swiglu`: the GELU is torch's, bit for bit; the norms have
their own reduction order (their float32 results may differ from torch's in the last bits; the
RMSNorm follows Hugging Face's roundings); the SwiGLU is computed in float32 with its own
exponential and rounded once, to FP8.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import require_choice
from ..encoders import ACTIVATIONS, Prologue, norm_kind, register_rms_norm, run_unfused
from .linear import Fp8Linear

__all__ = ["ACTIVATIONS", "Prologue", "linear_after", "register_rms_norm"]


def _plain_norm(norm: nn.Module, x: torch.Tensor) -> str | None:
    """The prologue kind ``norm`` folds into the next Linear as, or None: an ``nn.LayerNorm``
    or an RMSNorm (``nn.RMSNorm``, a :func:`register_rms_norm` class) over the last dim, with
    whole parameters and no hooks (ZeRO-3 gathers parameters in hooks: those modules run as
    they are)."""
    kind = norm_kind(norm)
    if kind is None or norm._forward_hooks or norm._forward_pre_hooks:
        return None
    width = (x.shape[-1],)
    if isinstance(norm, (nn.LayerNorm, nn.RMSNorm)) and tuple(norm.normalized_shape) != width:
        return None
    weight = norm.weight
    bias = norm.bias if kind == "layer_norm" else None  # (an RMSNorm has none)
    whole = (weight is None or weight.shape == width) and (bias is None or bias.shape == width)
    return kind if whole else None


def linear_after(linear: nn.Module, x: torch.Tensor, *, norm: nn.Module | None = None, activation: str | None = None):
    """``linear(activation(norm(x)))``, with the norm or the activation fused into an
    :class:`~lightning_fp8state.nn.Fp8Linear`'s input quantize where it can be.

    Either ``norm`` (a module applied to ``x``: an ``nn.LayerNorm`` or an RMSNorm fuses) or
    ``activation`` (one of ``ACTIVATIONS``: ``"gelu"``, or ``"swiglu"``, where ``x`` is a fused
    gate/up projection's output ``[gate, up]`` and ``linear`` takes half its width), not both.
    Any other Linear gets the plain composition.
    """
    if norm is not None:
        require_choice("activation", activation, (None,), why="linear_after takes norm or activation, not both")
    elif activation is not None:
        require_choice("activation", activation, ACTIVATIONS)
    if isinstance(linear, Fp8Linear):
        kind = None if norm is None else _plain_norm(norm, x)
        if kind is not None:
            return linear(x, prologue=kind, norm=norm)
        if activation is not None:
            return linear(x, prologue=activation)
    if norm is not None:
        x = norm(x)
    if activation is not None:
        x = run_unfused(activation, x)
    return linear(x)
