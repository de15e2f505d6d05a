"""``fp8_current``: per-tensor FP8 current (dynamic) scaling, like TransformerEngine's
``Float8CurrentScaling`` and torchao's tensorwise recipe.

Every call derives its scale from its own tensor's amax (:mod:`..ops.library_dynamic`): no
delayed state, no bank owner, nothing to commit. Owners, stamps and the ledger's counts stay
(an owner is still one layer × role × rank × stream × site, entered once per event). A
recompute re-derives its scale from its own input, so it is exact only if that input is
bitwise the true forward's: the protocol hands the input to the recompute auditor with the
codes, and the auditor compares both. The GEMMs are the per-tensor ones of fp8_delayed.
"""

from __future__ import annotations

import torch

from ..ops import quantize_fp8_t_record_amax
from ..ops.library_dynamic import current_scale, quantize_fp8_current
from .base import PerCallFp8Encoder, PerCallScales, register
from .delayed import PerTensorFp8

__all__ = ["CurrentFp8Encoder", "Fp8Current"]


class _GradStage:
    """grad_output's stage: its codes, their transpose and (``column_sum``) the bias gradient."""

    __slots__ = ("column_sum",)

    def __init__(self, column_sum: bool) -> None:
        self.column_sum = column_sum


_STAGES = {True: _GradStage(True), False: _GradStage(False)}


class CurrentFp8Encoder(PerCallFp8Encoder):
    """FP8 codes at this call's own per-tensor scale: ``encode_dynamic`` returns the data and
    ``(scale, descale, amax)``, 0-d float32 tensors on ``x``'s device."""

    def encode_dynamic(self, x: torch.Tensor, stage: _GradStage | None = None):
        with torch.no_grad():
            if stage is None:
                q, scale, descale, amax = quantize_fp8_current(x, self.dtype, self.margin)
                return q, scale, descale, amax
            # grad_output: the amax and scales (one read), then one read for the codes both ways
            # and the column sums
            scale, descale, amax = current_scale(x, self.dtype, self.margin)
            scratch = torch.zeros(1, dtype=torch.float32, device=x.device)  # read by no one
            q, q_t, sums = quantize_fp8_t_record_amax(x, scale, scratch, 0, self.dtype, stage.column_sum)
            return (q, q_t, sums if stage.column_sum else None), scale, descale, amax


@register
class Fp8Current(PerCallScales, PerTensorFp8):
    """Per-tensor FP8, each call's scale from its own amax (stateless)."""

    name = "fp8_current"
    per_call_encoder = CurrentFp8Encoder
    fuses_prologues = False  # the amax of the prologue's output is needed before its encode
    compiled_op = False
    summary = (
        "per-tensor FP8, scale from this call's own amax (stateless: no bank state, nothing committed); "
        "owners, stamps and ledger counts; recompute re-derives the scale, exact when its input is bitwise "
        "the forward's, which the auditor checks"
    )

    def grad_output_stage(self, column_sum: bool):
        return _STAGES[column_sum]

    def all_gather_problem(self) -> str | None:
        return (
            f"recipe={self.name!r}: its weight scale comes from the full weight's amax at each call, which "
            "an FP8 all-gather needs before it (torchao's precomputed scale: issue 28's GPU half); the "
            "weights gather in high precision meanwhile (fp8_all_gather=False)"
        )

    def telemetry(self, snap) -> dict[str, torch.Tensor]:
        return {"scale": snap.scale.reshape(()), "amax": snap.amax.reshape(())}
