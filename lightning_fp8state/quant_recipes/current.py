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
import torch.distributed as dist

from ..config import require_that
from ..formats import fp8_format
from ..ops import quantize_fp8, quantize_fp8_t_record_amax
from ..ops.library_dynamic import current_scale, quantize_fp8_current
from ..ops.reference_dynamic import dynamic_scale_reference
from .base import PerCallFp8Encoder, PerCallScales
from .delayed import PerTensorFp8
from .registry import register

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

    def encode(self, x: torch.Tensor, snap, prologue=None) -> torch.Tensor:
        """Codes of ``x`` at a scale derived elsewhere (``snap.scale``): a weight shard at its
        full weight's scale, before an FP8 all-gather. The encode of :meth:`encode_dynamic`
        (elementwise), so the gathered codes are bitwise the full weight's."""
        require_that(
            prologue is None, f"{type(self).__name__}.encode(prologue)", prologue, "None (a weight shard has none)"
        )
        with torch.no_grad():
            return quantize_fp8(x, snap.scale, self.dtype)


def _shard_amaxes(shards: list[torch.Tensor]) -> torch.Tensor:
    """``max |shard|`` of each shard, float32 ``[n]`` (0 for an empty shard; +inf where a shard
    holds NaN: the MAX of a NaN is not defined across ranks, and +inf gives the same scale 1)."""
    with torch.no_grad():
        out = [
            torch.linalg.vector_norm(s.detach(), float("inf")).float()
            if s.numel()
            else s.new_zeros((), dtype=torch.float32)
            for s in shards
        ]
        amax = torch.stack(out)
        return torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax)


@register
class Fp8Current(PerCallScales, PerTensorFp8):
    """Per-tensor FP8, each call's scale from its own amax (stateless)."""

    name = "fp8_current"
    per_call_encoder = CurrentFp8Encoder
    fuses_prologues = False  # the amax of the prologue's output is needed before its encode
    summary = (
        "per-tensor FP8, scale from this call's own amax (stateless: no bank state, nothing committed); "
        "owners, stamps and ledger counts; recompute re-derives the scale, exact when its input is bitwise "
        "the forward's, which the auditor checks"
    )

    def grad_output_stage(self, column_sum: bool):
        return _STAGES[column_sum]

    def gather_scales(self, shards: list[torch.Tensor], group):
        """The full weights' ``(scale, descale, amax)`` (float32 ``[n]``): the shards' amaxes in one
        buffer, one all-reduce (MAX) of it over ``group``, then the per-call formula
        (:func:`~lightning_fp8state.ops.reference_dynamic.dynamic_scale_reference`): what
        ``quantize_fp8_current`` of each full weight derives."""
        enc = self.encoder("weight")
        amax = _shard_amaxes(shards)
        if group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        with torch.no_grad():
            scale, descale = dynamic_scale_reference(amax, fp8_format(enc.dtype).max, enc.margin)
        return scale, descale, amax

    def telemetry(self, snap) -> dict[str, torch.Tensor]:
        return {"scale": snap.scale.reshape(()), "amax": snap.amax.reshape(())}
