"""``fp8_delayed`` (the product: per-tensor FP8 delayed scaling) and ``bf16`` (the control).

Delayed scaling's owners keep an amax history in the bank; a call quantizes with the event's
frozen scale and records its amax for a later one. Its GEMM is the per-tensor one of
:mod:`.gemm` (``torch._scaled_mm`` where the GPU has it, the exact emulation elsewhere): the
code below is what nn/linear_call.py did before recipes existed, moved, not changed.
"""

from __future__ import annotations

from ..encoders import CastTranspose
from .base import Recipe
from .gemm import scaled_matmul
from .registry import register

__all__ = ["Bf16", "Fp8Delayed", "PerTensorFp8"]

# grad_output's stage (stateless: one of each, shared): with and without the bias gradient
_CAST_TRANSPOSE = {True: CastTranspose(True), False: CastTranspose(False)}


class PerTensorFp8(Recipe):
    """The GEMMs of one scale per tensor: the codes of input, weight and grad_output serve
    all three products (transposed where needed). A weight encoded by the cast-transpose stage
    (:meth:`weight_stage`) is the triple ``(codes, codes transposed, None)``: the forward GEMM
    reads the codes, the input gradient's the transpose, so its backward transposes nothing."""

    def grad_output_stage(self, column_sum: bool):
        # one read of grad_output: its codes, their transpose and the bias gradient
        return _CAST_TRANSPOSE[column_sum]

    def linear_gemm(self, xq, wq, sx, sw, out_dtype, backend, bias):
        if type(wq) is tuple:
            wq = wq[0]
        return scaled_matmul(xq, wq.t(), sx.descale, sw.descale, out_dtype, backend, bias)

    def saved_for_backward(self, xq, wq, x2, weight) -> tuple:
        # the transposed codes as the [out, in] view the input gradient's GEMM takes without a copy
        return (xq, wq[1].t()) if type(wq) is tuple else (xq, wq)

    # ``out``: where the product is written (scaled_matmul's; the experts' gradients use it)
    def grad_weight(self, g_w, x_saved, sg, sx, out_dtype, backend, out=None):
        return scaled_matmul(g_w, x_saved, sg.descale, sx.descale, out_dtype, backend, out=out)

    def grad_input(self, g_x, w_saved, sg, sw, out_dtype, backend, out=None):
        return scaled_matmul(g_x, w_saved, sg.descale, sw.descale, out_dtype, backend, out=out)


@register
class Fp8Delayed(PerTensorFp8):
    """FP8 delayed scaling: every role an owner with an amax history in the bank."""

    name = "fp8_delayed"
    modes = ("safe", "naive", "naive_snapshot")

    weight_codes_once = True

    def weight_stage(self, weight):
        # A weight's codes and their transpose from one read, once per event: the recompute
        # reuses them (QuantProtocol), the backward reads the transpose. A non-contiguous weight
        # (Conv1D's transposed view) is encoded plainly: the kernel would copy it first.
        return _CAST_TRANSPOSE[False] if self.weight_codes_once and weight.is_contiguous() else None

    summary = (
        "per-tensor FP8, scale from the owner's amax history (delayed state in the bank); snapshots, "
        "one commit per owner per event, ledger, recompute reads the true forward's snapshot; FP8 "
        "all-gather under FSDP2; naive modes reproduce the defects"
    )


@register
class Bf16(Recipe):
    """No quantization at all: the control. Converted modules run their plain op."""

    name = "bf16"
    quantized = False
    summary = "no quantization (the control): plain GEMMs, no quantizer state; the audit still runs"
