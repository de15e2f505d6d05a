"""``fp8_rowwise`` and ``fp8_rowwise_gw_hp``: FP8 with one scale per row, like torchao's
``rowwise`` and ``rowwise_with_gw_hp`` recipes.

Each GEMM operand is scaled along the dimension it keeps (never along the one it sums over),
from its own high-precision tensor, at every call (stateless, as :mod:`.current`):

- forward ``y = x @ W^T``: ``x`` per row ``[M, 1]``, ``W`` per row, i.e. per output channel
  (``W^T``'s columns, ``[1, N]`` in the GEMM);
- input gradient ``dX = g @ W``: ``g`` per row ``[M, 1]``, ``W`` per column ``[1, K]``;
- weight gradient ``dW = g^T @ x``: ``g`` per column ``[N, 1]``, ``x`` per column ``[1, K]``;
  ``fp8_rowwise_gw_hp`` runs this one in high precision.

So a call saves its high-precision input and weight for the backward (as torchao does), and
grad_output is E4M3 in the shipped config (``configs/quant/fp8_rowwise.yaml``: cuBLASLt's
rowwise FP8 GEMM takes E4M3 operands only). On the CPU the GEMM is the delayed emulation's:
codes multiplied in float32, then the outer product of the paired descales, the bias, one
rounding. On a GPU with FP8 it is ``torch._scaled_mm`` with ``scale_a [M, 1]`` and
``scale_b [1, N]`` (float32), bitwise its emulation's codes and scales on the H200
(tests/gpu/test_recipes_cuda.py).
"""

from __future__ import annotations

import torch

from ..formats import PER_COLUMN, PER_ROW
from ..ops.library_dynamic import quantize_fp8_colwise, quantize_fp8_rowwise
from .base import LINEAR_GEMM_ROLES, GemmLayouts, Operand, PerCallFp8Encoder, PerCallScales, Recipe
from .gemm import _mm_device, warn_unless_e4m3
from .registry import register

__all__ = ["Fp8Rowwise", "Fp8RowwiseGwHp", "RowwiseFp8Encoder", "rowwise_matmul"]

_E4M3 = torch.float8_e4m3fn
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)
_MM_OUT = (torch.bfloat16, torch.float32)  # outputs the rowwise _scaled_mm path serves (float32: widened)


def rowwise_matmul(a, b, descale_a, descale_b, out_dtype, backend: str = "auto", bias=None) -> torch.Tensor:
    """``(a @ b) * (descale_a * descale_b) (+ bias)`` for FP8 ``a [M, K]`` with ``descale_a
    [M, 1]`` and ``b [K, N]`` with ``descale_b [1, N]``.

    ``backend``: ``auto`` (``_scaled_mm`` where the GPU has it and the operands allow it: both
    E4M3, a bfloat16 or float32 output, K and N multiples of 16), ``emulated`` or ``scaled_mm``.

    cuBLASLt's rowwise GEMM writes bfloat16 only. A float32 output (the backward's gradients
    of float32 master weights, or of a float32 input such as a LayerNorm's under autocast) is
    its bfloat16 result widened, the bias added in float32: what autocast's own linear and
    torchao's rowwise recipe compute. The float32 emulation instead is a float32 GEMM (without
    TF32 slower than the whole step's other GEMMs at the 350M shape, docs/PERFORMANCE.md).
    """
    use_mm = backend == "scaled_mm" or (
        backend == "auto"
        and a.dtype == _E4M3
        and b.dtype == _E4M3
        and out_dtype in _MM_OUT
        and a.shape[1] % 16 == 0
        and b.shape[1] % 16 == 0
        and _mm_device(a.device)
    )
    if not use_mm:
        # the delayed emulation's arithmetic: exact FP8 products accumulated in float32, then
        # the paired descales (here their outer product), the bias in float32, one rounding
        acc = (a.to(torch.float32) @ b.to(torch.float32)) * (descale_a.to(torch.float32) * descale_b.to(torch.float32))
        if bias is not None:
            acc = acc + bias.to(torch.float32)
        return acc.to(out_dtype)
    # cuBLASLt's rowwise FP8 GEMM (tests/gpu/test_recipes_cuda.py on the H200) wants a
    # row-major, b column-major, scale_a [M, 1] and scale_b [1, N] contiguous float32.
    if not a.is_contiguous():
        a = a.contiguous()
    if not b.t().is_contiguous():
        b = b.t().contiguous().t()
    sa = descale_a.to(torch.float32).reshape(a.shape[0], 1).contiguous()
    sb = descale_b.to(torch.float32).reshape(1, b.shape[1]).contiguous()
    if out_dtype == torch.float32:  # the bfloat16 GEMM, widened; the bias in float32
        out = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16).to(torch.float32)
        return out if bias is None else out + bias.to(torch.float32)
    if bias is not None and bias.dtype != out_dtype:
        bias = bias.to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype)


class _GradStage:
    """grad_output's stage: per-row codes (input gradient), the per-column codes of ``g`` as
    ``g^T``'s rows (weight gradient) or ``g`` itself (``high_precision``), the bias gradient."""

    __slots__ = ("column_sum", "high_precision")

    def __init__(self, column_sum: bool, high_precision: bool) -> None:
        self.column_sum, self.high_precision = column_sum, high_precision


class RowwiseFp8Encoder(PerCallFp8Encoder):
    """FP8 codes of a 2-D tensor with one scale per row, from each row's own amax:
    ``encode_dynamic`` returns the data and ``(scale, descale, amax)``, each ``[R, 1]``."""

    def encode_dynamic(self, x: torch.Tensor, stage: _GradStage | None = None):
        with torch.no_grad():
            q, scale, descale, amax = quantize_fp8_rowwise(x, self.dtype, self.margin)
            if stage is None:
                return q, scale, descale, amax
            if stage.high_precision:
                g_w = x
            else:
                q_t, _, descale_t, _ = quantize_fp8_colwise(x, self.dtype, self.margin)  # g^T's rows
                g_w = (q_t, descale_t)
            sums = x.sum(0, dtype=torch.float32) if stage.column_sum else None
            return (q, g_w, sums), scale, descale, amax


@register
class Fp8Rowwise(PerCallScales, Recipe):
    """FP8 with one scale per row of each GEMM operand (stateless)."""

    name = "fp8_rowwise"
    formats = ("e4m3", "e4m3")  # cuBLASLt's rowwise FP8 GEMM takes E4M3 operands only
    per_call_encoder = RowwiseFp8Encoder
    fuses_prologues = False
    saves_inputs = True  # the backward scales input and weight along their other dimension
    # the weight-gradient GEMM in high precision (fp8_rowwise_gw_hp)
    high_precision_weight_grad = False
    # each operand scaled along the dimension it keeps (the module doc)
    scale_layouts = dict.fromkeys(LINEAR_GEMM_ROLES, PER_ROW)
    gemm_layouts = GemmLayouts(
        forward=(Operand("input", PER_ROW), Operand("weight", PER_ROW)),
        grad_input=(Operand("grad_output", PER_ROW), Operand("weight", PER_COLUMN)),
        grad_weight=(Operand("grad_output", PER_COLUMN), Operand("input", PER_COLUMN)),
    )
    summary = (
        "FP8 with a scale per row of input and grad_output and per output channel of the weight, from "
        "this call's own amaxes (stateless); owners, stamps, ledger counts; recompute exact when its "
        "input is bitwise the forward's (audited)"
    )

    def __init__(self, config) -> None:
        super().__init__(config)
        warn_unless_e4m3(self.name, config, "rowwise")

    def grad_output_stage(self, column_sum: bool):
        return _GradStage(column_sum, self.high_precision_weight_grad)

    def linear_gemm(self, xq, wq, sx, sw, out_dtype, backend, bias):
        return rowwise_matmul(xq, wq.t(), sx.descale, sw.descale.t(), out_dtype, backend, bias)

    def saved_for_backward(self, xq, wq, x2, weight):
        return x2, weight  # the backward scales them along their other dimension

    def _columns(self, t: torch.Tensor, role: str):
        """``t [R, C]`` scaled per column: codes ``[R, C]`` (a transposed view) and descale ``[1, C]``."""
        with torch.no_grad():
            q_t, _, descale_t, _ = quantize_fp8_colwise(t, self.encoder(role).dtype, self.config.margin)
        return q_t.t(), descale_t.t()

    def grad_weight(self, g_w, x_saved, sg, sx, out_dtype, backend):
        if self.high_precision_weight_grad:
            # in grad_output's dtype when it is 16-bit (under autocast: the dtype autocast's own
            # linear computes in, as torchao's rowwise_with_gw_hp), else the operands' common one;
            # a float32 GEMM here cost the 350M step most of its time on the H200
            dtype = g_w.dtype if g_w.dtype in _SIXTEEN_BIT else torch.promote_types(g_w.dtype, x_saved.dtype)
            return (g_w.t().to(dtype) @ x_saved.to(dtype)).to(out_dtype)
        q_t, descale_t = g_w  # g^T per row: [N, M], [N, 1]
        xq, x_descale = self._columns(x_saved, "input")
        return rowwise_matmul(q_t, xq, descale_t, x_descale, out_dtype, backend)

    def grad_input(self, g_x, w_saved, sg, sw, out_dtype, backend):
        wq, w_descale = self._columns(w_saved, "weight")
        return rowwise_matmul(g_x, wq, sg.descale, w_descale, out_dtype, backend)

    def telemetry(self, snap) -> dict[str, torch.Tensor]:
        if snap.scale.numel() == 0:
            return {}
        return {"scale_min": snap.scale.min(), "scale_max": snap.scale.max(), "amax": snap.amax.max()}


@register
class Fp8RowwiseGwHp(Fp8Rowwise):
    """:class:`Fp8Rowwise` with the weight-gradient GEMM in high precision (torchao's
    ``rowwise_with_gw_hp``)."""

    name = "fp8_rowwise_gw_hp"
    high_precision_weight_grad = True
    gemm_layouts = GemmLayouts(
        forward=Fp8Rowwise.gemm_layouts.forward,
        grad_input=Fp8Rowwise.gemm_layouts.grad_input,
        grad_weight=(Operand("grad_output", None), Operand("input", None)),
    )
    summary = Fp8Rowwise.summary + "; the weight gradient in high precision"
