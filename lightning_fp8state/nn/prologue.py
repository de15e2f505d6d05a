"""Prologues: the op that produces an Fp8Linear's input, fused into the input's quantize.

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

from .. import ops
from ..ops.library_fused import layer_norm_width_ok

__all__ = ["ACTIVATIONS", "Prologue", "linear_after"]

ACTIVATIONS = ("gelu",)


class Prologue:
    """One call's prologue: ``layer_norm`` (a module's affine and eps) or ``gelu``.

    ``stats`` holds the LayerNorm's ``(mean, rstd)`` after :meth:`quantize` or :meth:`apply`
    ran (the caller saves them for :meth:`backward`).
    """

    __slots__ = ("bias", "eps", "kind", "stats", "weight")

    def __init__(self, kind: str, weight=None, bias=None, eps: float = 0.0) -> None:
        self.kind, self.weight, self.bias, self.eps = kind, weight, bias, eps
        self.stats: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def layer_norm(cls, norm: nn.LayerNorm) -> Prologue:
        return cls("layer_norm", norm.weight, norm.bias, norm.eps)

    def _fusable(self, x: torch.Tensor) -> bool:
        if self.kind == "gelu":
            return True
        affine_ok = all(t is None or t.dtype == torch.float32 for t in (self.weight, self.bias))
        return affine_ok and layer_norm_width_ok(x.dtype, x.shape[-1])

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The prologue's output as a tensor (no autograd): for paths without a fused kernel."""
        with torch.no_grad():
            if self.kind == "gelu":
                return F.gelu(x)
            d = x.shape[-1]
            y, mean, rstd = torch.ops.aten.native_layer_norm(x, [d], self.weight, self.bias, self.eps)
            self.stats = (mean, rstd)
            return y

    def quantize(self, x: torch.Tensor, scale, dtype, amax_pending=None, slot: int = 0) -> torch.Tensor:
        """FP8 codes of the prologue's output (recording its amax into ``amax_pending[slot]``
        when given): fused where a kernel takes the shape, else applied, then quantized."""
        with torch.no_grad():
            if not self._fusable(x):
                y = self.apply(x)
                if amax_pending is None:
                    return ops.quantize_fp8(y, scale, dtype)
                return ops.quantize_fp8_record_amax(y, scale, amax_pending, slot, dtype)
            if self.kind == "gelu":
                return ops.gelu_quantize_fp8(x, scale, dtype, amax_pending, slot)
            q, mean, rstd = ops.layer_norm_quantize_fp8(
                x, self.weight, self.bias, self.eps, scale, dtype, amax_pending, slot
            )
            self.stats = (mean, rstd)
            return q

    def backward(self, grad_y: torch.Tensor, x: torch.Tensor, stats: tuple, needs: tuple[bool, bool, bool]):
        """Gradients of ``(x, weight, bias)`` from the gradient of the prologue's output
        (``stats``: the LayerNorm's saved ``(mean, rstd)``; empty for the GELU)."""
        if self.kind == "gelu":
            return torch.ops.aten.gelu_backward(grad_y, x), None, None
        mean, rstd = stats
        return torch.ops.aten.native_layer_norm_backward(
            grad_y, x, [x.shape[-1]], mean, rstd, self.weight, self.bias, list(needs)
        )


def _plain_norm(norm: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``norm`` can be folded into the next Linear: an ``nn.LayerNorm`` over the last
    dim with whole parameters and no hooks (ZeRO-3 gathers parameters in hooks: those
    modules run as they are)."""
    if type(norm) is not nn.LayerNorm or tuple(norm.normalized_shape) != (x.shape[-1],):
        return False
    if norm._forward_hooks or norm._forward_pre_hooks:
        return False
    return all(p is None or tuple(p.shape) == (x.shape[-1],) for p in (norm.weight, norm.bias))


def linear_after(linear: nn.Module, x: torch.Tensor, *, norm: nn.Module | None = None, activation: str | None = None):
    """``linear(activation(norm(x)))``, with the norm or the activation fused into an
    :class:`~lightning_fp8state.nn.Fp8Linear`'s input quantize where it can be.

    Either ``norm`` (a module applied to ``x``) or ``activation`` (one of ``ACTIVATIONS``),
    not both. Any other Linear gets the plain composition.
    """
    from .linear import Fp8Linear  # noqa: PLC0415  (linear imports this module)

    if norm is not None and activation is not None:
        raise ValueError("linear_after: pass norm or activation, not both")
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"linear_after: activation={activation!r} is not allowed: expected one of {ACTIVATIONS}")
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
