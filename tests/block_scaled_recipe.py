"""A block-scaled FP8 recipe written only from the recipe plug-in's parts, for tests: its scale
layouts are data (1 x T tiles for input and grad_output, T x T blocks for the weight, T x 1 tiles
for the weight gradient's operands), its encode and GEMMs a plain-torch emulation. Registered
for a test's duration (``registered``), it runs through the protocol, the auditor, checkpoints,
the FSDP2 refusal and per-block graphs with no line outside quant_recipes/ knowing its layout:
the proof that a scale layout is the recipe's data. Small tiles (T = 8) so that the 16- and
32-wide layers of the tests hold several of them."""

from __future__ import annotations

import contextlib

import torch

from lightning_fp8state.formats import ScaleLayout, fp8_format
from lightning_fp8state.ops.reference_dynamic import dynamic_scale_reference
from lightning_fp8state.quant_recipes import RECIPE_CLASSES, GemmLayouts, Operand, Recipe
from lightning_fp8state.quant_recipes.base import PerCallFp8Encoder, PerCallScales

T = 8
TILE = ScaleLayout(f"1x{T}", 1, T)
BLOCK = ScaleLayout(f"{T}x{T}", T, T)
COLUMN_TILE = ScaleLayout(f"{T}x1", T, 1)
NAME = "test_block_scaled"


def block_quantize(x: torch.Tensor, layout: ScaleLayout, dtype: torch.dtype, margin: int):
    """``x [R, C]`` as FP8 codes with one scale per tile of ``layout``: ``(codes, scale,
    descale, amax)``, the last three shaped ``layout.scale_shape``."""
    r, c = x.shape
    rows, cols = layout.scale_shape(x.shape)
    tr, tc = layout.rows or r, layout.cols or c
    padded = x.detach().float().new_zeros(rows * tr, cols * tc)
    padded[:r, :c] = x.detach().float().abs()
    amax = padded.reshape(rows, tr, cols, tc).amax(dim=(1, 3))
    fmax = fp8_format(dtype).max
    scale, descale = dynamic_scale_reference(amax, fmax, margin)
    q = (x.detach().float() * layout.expand(scale, x.shape)).clamp(-fmax, fmax).to(dtype)
    return q, scale, descale, amax


def _decoded(q: torch.Tensor, descale: torch.Tensor, layout: ScaleLayout) -> torch.Tensor:
    return q.float() * layout.expand(descale, q.shape)


class _GradStage:
    __slots__ = ("column_sum",)

    def __init__(self, column_sum: bool) -> None:
        self.column_sum = column_sum


class BlockEncoder(PerCallFp8Encoder):
    """Codes at this call's own per-tile scales (the role's layout)."""

    def __init__(self, name: str, margin: int, layout: ScaleLayout) -> None:
        super().__init__(name, margin)
        self.layout = None  # (the FP4 field: not an FP4 encoder)
        self.tiles = layout

    def encode_dynamic(self, x: torch.Tensor, stage: _GradStage | None = None):
        with torch.no_grad():
            q, scale, descale, amax = block_quantize(x, self.tiles, self.dtype, self.margin)
            if stage is None:
                return q, scale, descale, amax
            sums = x.sum(0, dtype=torch.float32) if stage.column_sum else None
            return (q, x, sums), scale, descale, amax  # x: re-encoded in column tiles for dW


class BlockScaled(PerCallScales, Recipe):
    name = NAME
    per_call_encoder = BlockEncoder
    fuses_prologues = False
    saves_inputs = True  # the weight gradient re-encodes the input in column tiles
    scale_layouts = {"input": TILE, "weight": BLOCK, "grad_output": TILE}
    gemm_layouts = GemmLayouts(
        forward=(Operand("input", TILE), Operand("weight", BLOCK)),
        grad_input=(Operand("grad_output", TILE), Operand("weight", BLOCK)),
        grad_weight=(Operand("grad_output", COLUMN_TILE), Operand("input", COLUMN_TILE)),
    )

    def _make_encoder(self, role: str):
        if self.attention_role(role):
            return super()._make_encoder(role)
        name = self.config.backward_format if role == "grad_output" else self.config.forward_format
        return BlockEncoder(name, self.config.margin, self.scale_layouts[role])

    def grad_output_stage(self, column_sum: bool):
        return _GradStage(column_sum)

    def linear_gemm(self, xq, wq, sx, sw, out_dtype, backend, bias):
        y = _decoded(xq, sx.descale, TILE) @ _decoded(wq, sw.descale, BLOCK).t()
        return (y if bias is None else y + bias.float()).to(out_dtype)

    def saved_for_backward(self, xq, wq, x2, weight):
        return x2, weight

    def _encoded(self, t: torch.Tensor, role: str, layout: ScaleLayout) -> torch.Tensor:
        q, _, descale, _ = block_quantize(t, layout, self.encoder(role).dtype, self.config.margin)
        return _decoded(q, descale, layout)

    def grad_weight(self, g_w, x_saved, sg, sx, out_dtype, backend):
        g = self._encoded(g_w, "grad_output", COLUMN_TILE)
        return (g.t() @ self._encoded(x_saved, "input", COLUMN_TILE)).to(out_dtype)

    def grad_input(self, g_x, w_saved, sg, sw, out_dtype, backend):
        return (_decoded(g_x, sg.descale, TILE) @ self._encoded(w_saved, "weight", BLOCK)).to(out_dtype)


@contextlib.contextmanager
def registered():
    """``quant.recipe=test_block_scaled`` valid inside the block, as a registered recipe is."""
    RECIPE_CLASSES[NAME] = BlockScaled
    try:
        yield BlockScaled
    finally:
        del RECIPE_CLASSES[NAME]
