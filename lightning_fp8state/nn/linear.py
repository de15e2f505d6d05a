"""Fp8Linear: nn.Linear whose input, weight and grad_output are delayed-scaled FP8 owners."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..encoders import ACTIVATIONS, CastTranspose, Prologue
from ..protocol import QuantProtocol
from ..recompute import Phase
from .gemm import scaled_matmul

__all__ = ["Fp8Linear", "LINEAR_ROLES"]

LINEAR_ROLES = ("input", "weight", "grad_output")
# grad_output's stage (stateless: one of each, shared): with and without the bias gradient
_CAST_TRANSPOSE = {True: CastTranspose(True), False: CastTranspose(False)}


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        norm_weight,
        norm_bias,
        protocol: QuantProtocol,
        record,
        phase: Phase,
        out_dtype,
        backend,
        prologue: Prologue | None,
    ):
        x2 = x.reshape(-1, x.shape[-1])
        xq, sx = protocol.quantize(record, "input", x2, phase, prologue)
        gathered = getattr(weight, "fp8", None)  # an FSDP2 FP8 all-gather's codes (nn/fsdp.py)
        if gathered is not None:
            wq, sw = protocol.adopt(record, "weight", gathered, weight.snapshot, phase)
        else:
            wq, sw = protocol.quantize(record, "weight", weight, phase)
        if phase is not Phase.INFERENCE:
            protocol.check_consumer(record, "input", sx)
            protocol.check_consumer(record, "weight", sw)
        y = scaled_matmul(xq, wq.t(), sx.descale, sw.descale, out_dtype, backend, bias)
        # with a prologue, its input is kept for its backward (as the unfused op would keep it)
        saved = (xq, wq) if prologue is None else (xq, wq, x2, *(prologue.stats or ()))
        ctx.save_for_backward(*saved)
        if prologue is not None:
            prologue.stats = None  # saved above (through the saved-tensor hooks), not held twice
        ctx.snaps = (sx, sw)
        ctx.protocol, ctx.record, ctx.backend, ctx.prologue = protocol, record, backend, prologue
        ctx.x_dtype, ctx.x_shape, ctx.w_dtype = x.dtype, x.shape, weight.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        xq, wq, *prologue_saved = ctx.saved_tensors
        sx, sw = ctx.snaps
        protocol, record, prologue = ctx.protocol, ctx.record, ctx.prologue
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        if not g2.is_contiguous():
            g2 = g2.contiguous()
        needs = ctx.needs_input_grad
        want_bias = ctx.has_bias and needs[2]
        # one read of grad_output (always an FP8 format): its codes, their transpose and the bias gradient
        (gq, gq_t, g_sums), sg = protocol.quantize(record, "grad_output", g2, Phase.FORWARD, _CAST_TRANSPOSE[want_bias])
        for snap, role in ((sx, "input"), (sw, "weight"), (sg, "grad_output")):
            protocol.check_consumer(record, role, snap)
        grad_x = grad_w = grad_b = grad_nw = grad_nb = None
        # The weight gradient first: its operands (gq^T, and the transpose of xq made inside)
        # are freed before the input gradient (float32 where x is) and the prologue's backward
        # allocate theirs, so the two sets never coexist.
        if needs[1]:
            grad_w = scaled_matmul(gq_t, xq, sg.descale, sx.descale, ctx.w_dtype, ctx.backend)
        del gq_t
        if want_bias:
            grad_b = g_sums.to(ctx.bias_dtype)
        if needs[0] or needs[3] or needs[4]:
            grad_x = scaled_matmul(gq, wq, sg.descale, sw.descale, ctx.x_dtype, ctx.backend)
            del gq
            if prologue is not None:
                x2, *stats = prologue_saved
                grad_x, grad_nw, grad_nb = prologue.backward(grad_x, x2, tuple(stats), (needs[0], needs[3], needs[4]))
            grad_x = None if grad_x is None else grad_x.reshape(ctx.x_shape)
        return grad_x, grad_w, grad_b, grad_nw, grad_nb, None, None, None, None, None, None


class Fp8Linear(nn.Linear):
    """A drop-in ``nn.Linear`` driven by a :class:`QuantProtocol`.

    Input and weight are E4M3 (forward roles), grad_output E5M2 (backward role), each an
    owner of its own delayed state. Under the ``bf16`` recipe it runs plain ``F.linear``
    and holds no quantizer state, but still reports its calls to the audit.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        protocol: QuantProtocol,
        layer_name: str,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.protocol = getattr(protocol, "protocol", protocol)  # an Fp8State's protocol
        self.layer_name = layer_name

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, protocol: QuantProtocol, layer_name: str) -> Fp8Linear:
        """Wrap an existing ``nn.Linear``, sharing its parameters (optimizers keep working)."""
        new = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            protocol=protocol,
            layer_name=layer_name,
            device="meta",
        )
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layer={self.layer_name!r}, recipe={self.protocol.config.recipe}"

    def forward(
        self, x: torch.Tensor, *, prologue: str | None = None, norm: nn.LayerNorm | None = None
    ) -> torch.Tensor:
        """``self(x)``; with ``prologue="layer_norm"`` (and ``norm``) or ``prologue="gelu"``,
        ``self(norm(x))`` or ``self(gelu(x))`` with that op fused into the input's quantize
        (:func:`~lightning_fp8state.nn.linear_after` is the caller's entry point)."""
        # The protocol's bookkeeping is Python with side effects: under torch.compile the call
        # is a graph break and runs eager (the code around it compiles). Eagerly the call goes
        # straight in: the disable wrapper's frame handling costs host time on every call.
        if torch.compiler.is_compiling():
            return self._forward_outside_graph(x, prologue, norm)
        return self._forward(x, prologue, norm)

    def _forward(self, x: torch.Tensor, prologue: str | None, norm: nn.LayerNorm | None) -> torch.Tensor:
        protocol = self.protocol
        config = protocol.config
        fused = self._prologue(prologue, norm)
        if fused is not None and not (config.quantized and config.fuse_prologues):
            x = norm(x) if prologue == "layer_norm" else F.gelu(x)  # the same op, unfused
            fused = None
        roles = LINEAR_ROLES if config.quantized else ()
        phase, record = protocol.enter_call(self.layer_name, roles, x.device)
        if not config.quantized:
            out = F.linear(x, self.weight, self.bias)
            protocol.observe_output(record, phase, out, {})
            return out
        if not x.is_contiguous():
            x = x.contiguous()
        nw, nb = (norm.weight, norm.bias) if fused is not None and fused.kind == "layer_norm" else (None, None)
        args = (x, self.weight, self.bias, nw, nb, protocol, record, phase)
        if torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                out = _Fp8LinearFn.apply(*args, torch.get_autocast_dtype(x.device.type), config.gemm, fused)
        else:
            out = _Fp8LinearFn.apply(*args, x.dtype, config.gemm, fused)
        protocol.observe_output(record, phase, out, record.used)
        return out

    _forward_outside_graph = torch.compiler.disable(_forward)

    @staticmethod
    def _prologue(prologue: str | None, norm: nn.LayerNorm | None) -> Prologue | None:
        if prologue is None:
            if norm is not None:
                raise ValueError('Fp8Linear: norm is only taken with prologue="layer_norm"')
            return None
        if prologue == "layer_norm":
            if not isinstance(norm, nn.LayerNorm):
                raise ValueError(
                    f'Fp8Linear: prologue="layer_norm" needs norm=<nn.LayerNorm>, got {type(norm).__name__}'
                )
            return Prologue.layer_norm(norm)
        if prologue in ACTIVATIONS:
            return Prologue(prologue)
        raise ValueError(
            f"Fp8Linear: prologue={prologue!r} is not allowed: expected None, 'layer_norm' or one of {ACTIVATIONS}"
        )
