"""Fp4AttentionQuantizer: packed-FP4 attention operands (q, k, optionally v), one owner per layer and role.

Two ways to use it inside any attention implementation::

    self.attn_quant = Fp4AttentionQuantizer()            # bound by state.convert(model)
    ...
    out = self.attn_quant.attention(q, k, v, is_causal=True)  # fn defaults to SDPA
    # or, for code that wants the operands themselves:
    q, k = self.attn_quant(q, k)

``attention(q, k, v, fn=...)`` quantizes the operands, runs ``fn`` on their dequantized
values (GPUs without FP4 math) and saves only the packed uint8 codes, the block scales and
the snapshots for backward, so the operands' activation memory shrinks to about 9/32 of
bf16 (NVFP4); backward dequantizes them again (bit-identical) and re-runs ``fn`` to
differentiate it, like FlashAttention's own backward. ``forward(q, k[, v])`` returns the
dequantized operands for an attention that needs tensors; whatever consumes them then
saves them at full size.

Gradients pass straight through the quantizer (straight-through estimator): the gradient
of a quantized operand is the gradient of its dequantized value. The quantizer's state (FP4
tensor scale, and for the centered variant the running center) follows the protocol exactly
like ``Fp8Linear``'s: snapshot per event, pairing, one commit per owner per event,
read-only and bit-identical recompute.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..config import require_name, require_that
from ..formats import FP4_LAYOUTS
from ..protocol import QuantProtocol
from ..recompute import Phase

__all__ = ["Fp4AttentionQuantizer"]

_OPERANDS = ("attn_q", "attn_k", "attn_v")


def _quantize(protocol: QuantProtocol, record, role: str, x: torch.Tensor, phase: Phase):
    (packed, block_scales), snap = protocol.quantize(record, role, x, phase)
    if phase is not Phase.INFERENCE:
        protocol.check_consumer(record, role, snap)
    return packed, block_scales, snap


def _decode(packed: torch.Tensor, block_scales: torch.Tensor, snap, dtype: torch.dtype) -> torch.Tensor:
    return ops.dequantize_fp4(packed, block_scales, snap.descale, snap.layout, dtype, snap.center)


class _Fp4FakeQuantFn(torch.autograd.Function):
    """x -> decode(encode(x)) with the call's paired snapshot; backward is straight-through."""

    @staticmethod
    def forward(ctx, x, protocol: QuantProtocol, record, role: str, phase: Phase):
        packed, block_scales, snap = _quantize(protocol, record, role, x, phase)
        return _decode(packed, block_scales, snap, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None


class _Fp4AttentionFn(torch.autograd.Function):
    """fn(decode(encode(q)), decode(encode(k)), v or decode(encode(v))), saving packed operands."""

    @staticmethod
    def forward(ctx, fn, kwargs, protocol, record, phase, roles, sink, preserve_rng, q, k, v):
        given = dict(zip(_OPERANDS, (q, k, v), strict=True))
        operands, saved, snaps, dtypes = {}, [], {}, {}
        for role in roles:
            packed, block_scales, snap = _quantize(protocol, record, role, given[role], phase)
            operands[role] = _decode(packed, block_scales, snap, given[role].dtype)
            saved += [packed, block_scales]
            snaps[role], dtypes[role] = snap, given[role].dtype
        if "attn_v" not in roles:
            operands["attn_v"] = v
            saved.append(v)
        ctx.save_for_backward(*saved)
        ctx.fn, ctx.kwargs, ctx.protocol, ctx.record = fn, kwargs, protocol, record
        ctx.roles, ctx.snaps, ctx.dtypes = roles, snaps, dtypes
        ctx.device_type = q.device.type
        ctx.autocast = (torch.is_autocast_enabled(ctx.device_type), torch.get_autocast_dtype(ctx.device_type))
        ctx.rng = ctx.cuda_rng = None
        if preserve_rng:
            ctx.rng = torch.get_rng_state()
            if q.device.type == "cuda":
                ctx.cuda_rng = (q.device, torch.cuda.get_rng_state(q.device))
        sink.extend(operands[r] for r in roles)
        return fn(*(operands[r] for r in _OPERANDS), **kwargs)

    @staticmethod
    def backward(ctx, grad_out):
        saved = list(ctx.saved_tensors)
        leaves = {}
        for role in ctx.roles:
            packed, block_scales = saved.pop(0), saved.pop(0)
            snap = ctx.protocol.check_consumer(ctx.record, role, ctx.snaps[role])
            leaves[role] = _decode(packed, block_scales, snap, ctx.dtypes[role])
        if "attn_v" not in ctx.roles:
            leaves["attn_v"] = saved.pop(0).detach()
        wants = dict(zip(_OPERANDS, ctx.needs_input_grad[8:], strict=True))
        for role, leaf in leaves.items():
            leaf.requires_grad_(wants[role])
        cuda_devices = [ctx.cuda_rng[0]] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=cuda_devices, enabled=ctx.rng is not None):
            if ctx.rng is not None:
                torch.set_rng_state(ctx.rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng[1], ctx.cuda_rng[0])
            enabled, dtype = ctx.autocast
            with torch.enable_grad(), torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled):
                out = ctx.fn(*(leaves[r] for r in _OPERANDS), **ctx.kwargs)
        inputs = [leaves[r] for r in _OPERANDS if wants[r]]
        grads = iter(torch.autograd.grad(out, inputs, grad_out, allow_unused=True))
        per_operand = [next(grads) if wants[r] else None for r in _OPERANDS]
        return (None,) * 8 + tuple(per_operand)


class Fp4AttentionQuantizer(nn.Module):
    """Packed-FP4 quantizer of one attention layer's operands: q and k (roles ``attn_q``,
    ``attn_k``) and, with ``QuantConfig.attn_quantize_v``, v (``attn_v``).

    Each (layer, role) is its own owner of delayed state (``QuantConfig.ownership``:
    ``per_layer*`` is the fix, ``per_model`` shares one state across layers, the defect).
    The layout is ``QuantConfig.attn_format`` (``nvfp4`` | ``mxfp4``), the centered variant
    ``QuantConfig.attn_centered``. Under ``recipe="bf16"`` it passes operands through
    unchanged (the control) but still reports its calls to the audit.

    Args:
        protocol: the state (``Fp8State``) that owns its delayed state; ``state.convert(model)``
            binds every unbound quantizer of the model and names it after its module path.
        layer_name: its layer's name (the owner key's ``layer``); required with ``protocol``.
    """

    def __init__(self, *, protocol: QuantProtocol | None = None, layer_name: str | None = None) -> None:
        super().__init__()
        self.protocol: QuantProtocol | None = None
        self.layer_name: str | None = None
        if protocol is not None:
            self.bind(protocol, layer_name)

    def bind(self, protocol: QuantProtocol, layer_name: str | None) -> Fp4AttentionQuantizer:
        """Attach to ``protocol`` under ``layer_name``; returns ``self``."""
        require_name("layer_name", layer_name, "a non-empty string naming the layer")
        self.protocol, self.layer_name = getattr(protocol, "protocol", protocol), layer_name  # an Fp8State's
        return self

    def extra_repr(self) -> str:
        if self.protocol is None:
            return "unbound"
        cfg = self.protocol.config
        return f"layer={self.layer_name!r}, format={cfg.attn_format}, centered={cfg.attn_centered}"

    def _enter(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None):
        protocol = self.protocol
        if protocol is None:
            raise RuntimeError(
                "Fp4AttentionQuantizer is not bound to any state: call state.convert(model) or "
                "construct it with protocol=state, layer_name=..."
            )
        config = protocol.config
        roles: tuple[str, ...] = ()
        if protocol.recipe.quantized:
            roles = ("attn_q", "attn_k") + (("attn_v",) if config.attn_quantize_v and v is not None else ())
        tensors = dict(zip(_OPERANDS, (q, k, v), strict=True))
        if roles:
            block = FP4_LAYOUTS[config.attn_format].block_size
            for role in roles:
                width = tensors[role].shape[-1] if tensors[role].dim() else 0
                require_that(
                    width > 0 and width % block == 0,
                    f"layer {self.layer_name!r}: {role}.shape[-1]",
                    width,
                    f"a positive multiple of {block}, the {config.attn_format} block size (channels)",
                )
        channels = {role: tensors[role].shape[-1] for role in roles}
        phase, record = protocol.enter_call(self.layer_name, roles, q.device, channels=channels)
        return protocol, phase, record, roles

    @torch.compiler.disable  # protocol bookkeeping: a graph break under torch.compile
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None):
        """Quantize and dequantize q and k (and v if configured); returns ``(q, k)`` or
        ``(q, k, v)`` (an unquantized v is returned as given)."""
        protocol, phase, record, roles = self._enter(q, k, v)
        given = dict(zip(_OPERANDS, (q, k, v), strict=True))
        out = dict(given)
        for role in roles:
            out[role] = _Fp4FakeQuantFn.apply(given[role], protocol, record, role, phase)
        protocol.observe_output(record, phase, tuple(out[r] for r in roles), record.used)
        return (out["attn_q"], out["attn_k"]) if v is None else (out["attn_q"], out["attn_k"], out["attn_v"])

    @torch.compiler.disable  # protocol bookkeeping: a graph break under torch.compile
    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fn: Callable[..., torch.Tensor] = F.scaled_dot_product_attention,
        *,
        preserve_rng_state: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        """``fn(q, k, v, **kwargs)`` on the quantized operands, saving only packed FP4 for backward.

        Args:
            q: the queries (last dimension a multiple of the block size).
            k: the keys (likewise).
            v: the values (likewise).
            fn: any attention returning one tensor; it runs once in forward and once more in
                backward (on bit-identical dequantized operands) to be differentiated.
            preserve_rng_state: replay the RNG state in backward's re-run (needed if ``fn``
                draws random numbers, e.g. attention dropout).
            **kwargs: passed to ``fn`` (e.g. ``is_causal=True``).
        """
        protocol, phase, record, roles = self._enter(q, k, v)
        if not roles:
            out = fn(q, k, v, **kwargs)
            protocol.observe_output(record, phase, (q, k), {})
            return out
        sink: list[torch.Tensor] = []
        out = _Fp4AttentionFn.apply(fn, kwargs, protocol, record, phase, roles, sink, preserve_rng_state, q, k, v)
        protocol.observe_output(record, phase, tuple(sink), record.used)
        return out
