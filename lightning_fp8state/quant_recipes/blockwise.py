"""``fp8_blockwise`` and ``fp8_blockwise_pow2``: block-scaled FP8 as DeepSeek-V3 trains, like
TransformerEngine's ``Float8BlockScaling``: activations and gradients in 1x128 tiles, weights in
128x128 blocks, every scale from its own tile's amax at every call (stateless, as
:mod:`.current`; numerics: :mod:`..ops.reference_blockwise`). ``fp8_blockwise_pow2`` rounds each
scale down to a power of two (exact descales; what the DeepSeek-V3 recipe uses).

Each GEMM operand is tiled along the dimension the GEMM sums over (``K``):

- forward ``y = x @ W^T``: ``x`` in 1x128 tiles, ``W`` in 128x128 blocks;
- input gradient ``dX = g @ W``: ``g`` in 1x128 tiles, ``W`` in the same 128x128 blocks (the
  transpose's blocks are the blocks transposed: the block encode writes both layouts at once);
- weight gradient ``dW = g^T @ x``: ``g`` and ``x`` in 128x1 tiles (along the tokens), each
  encoded from its high-precision tensor with its codes written transposed.

So a call saves its high-precision input and weight (as fp8_rowwise does): the backward encodes
the input in column tiles and the weight's blocks again (bitwise the forward's codes: same
weight, same per-call formula). Owners, stamps, the ledger, the auditor, checkpoint refusal and
per-block graphs are the protocol's, unchanged; nothing outside this package knows the layouts.

The GEMM (:func:`blockwise_matmul`): on a GPU with cuBLASLt's block-scaled FP8 GEMM (sm90,
CUDA 12.9 or later) ``torch._scaled_mm`` with 1x128 / 128x128 float32 scales, where the shapes
allow it (E4M3 operands, ``K`` a multiple of 512, ``N`` of 128, ``M`` of 16; a bfloat16 result,
widened for a float32 output). Elsewhere an emulation that computes what that GEMM computes,
up to the order of its float32 accumulation: for each 128-wide slice of ``K``, the FP8 codes
multiplied exactly and summed in float32, that partial product scaled by the two operands'
descales of the slice (``descale_a[m] * descale_b[n]``) and added to a float32 accumulator;
then the bias in float32 and one rounding to the output dtype.

FSDP2's FP8 all-gather (``fp8_all_gather``, nn/fsdp.py) sends the weight's codes with their
block scales where the shards align: FSDP2 splits a weight's rows over the shard group, and
when every shard holds the same number of rows, a multiple of 128, each shard's 128x128 blocks
are exactly the full weight's. Each rank then encodes its own rows in blocks (their scales
from its own values: no collective for the scales, :attr:`Recipe.shard_scales`) and sends its
codes with its ``[rows / 128, ceil(cols / 128)]`` scales, descales and amaxes; the gathered
codes and scales are bitwise what encoding the full weight gives, and the input gradient reads
the gathered blocks (a 128x128 block's scale is its transpose's) instead of encoding a
high-precision weight it no longer has. Where the shards do not align (rows per shard not a
multiple of 128, or an uneven split), that weight gathers in high precision and a
:class:`~lightning_fp8state.errors.ConversionWarning` names the layer, its shards' rows and the
128-row requirement, once; its calls then encode the gathered weight as without FSDP2.
"""

from __future__ import annotations

import functools

import torch

from ..formats import BLOCK_128X128, TILE_1X128, ScaleLayout
from ..ops.library_blockwise import quantize_fp8_block, quantize_fp8_tile, quantize_fp8_tile_pair, quantize_fp8_tile_t
from ..ops.reference_blockwise import BLOCK
from .base import GemmLayouts, Operand, PerCallFp8Encoder, PerCallScales, Recipe
from .gemm import _mm_device, warn_unless_e4m3
from .registry import register

__all__ = ["COLUMN_TILE_128X1", "BlockwiseFp8Encoder", "Fp8Blockwise", "Fp8BlockwisePow2", "blockwise_matmul"]

# the weight gradient's operands: 128 x 1 tiles of g [tokens, out] and x [tokens, in]
COLUMN_TILE_128X1 = ScaleLayout("128x1", BLOCK, 1)

_E4M3 = torch.float8_e4m3fn
_MM_OUT = (torch.bfloat16, torch.float32)  # the block-scaled GEMM writes bfloat16 (float32: widened)


@functools.cache
def _cuda_blockwise() -> bool:
    """Whether this torch's CUDA has cuBLASLt's block-scaled FP8 GEMM (CUDA 12.9 or later)."""
    version = torch.version.cuda
    if not version:
        return False
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) >= (12, 9)


def _uses_scaled_mm(a, b, out_dtype, backend: str) -> bool:
    if backend == "scaled_mm":
        return True
    m, k = a.shape
    return (
        backend == "auto"
        and a.dtype == _E4M3
        and b.dtype == _E4M3
        and out_dtype in _MM_OUT
        and m % 16 == 0
        and k % (4 * BLOCK) == 0
        and b.shape[1] % BLOCK == 0
        and _mm_device(a.device)
        and _cuda_blockwise()
    )


def _emulated(a, b, descale_a, descale_b, out_dtype, bias) -> torch.Tensor:
    """The block-scaled GEMM's arithmetic in float32, one 128-wide slice of ``K`` at a time (the
    module doc)."""
    m, k = a.shape
    n = b.shape[1]
    acc = torch.zeros((m, n), dtype=torch.float32, device=a.device)
    per_column = descale_b.shape[1] == n  # 1x128 tiles of b's columns, else 128x128 blocks
    for kb in range(-(-k // BLOCK)):
        ks = slice(kb * BLOCK, (kb + 1) * BLOCK)
        part = a[:, ks].to(torch.float32) @ b[ks].to(torch.float32)
        sb = descale_b[kb] if per_column else descale_b[kb].repeat_interleave(BLOCK)[:n]
        acc += part * (descale_a[:, kb : kb + 1] * sb.reshape(1, n))
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


def blockwise_matmul(a, b, descale_a, descale_b, out_dtype, backend: str = "auto", bias=None) -> torch.Tensor:
    """``a @ b`` of block-scaled FP8 operands (``+ bias``): ``a [M, K]`` in 1x128 tiles along
    ``K`` (``descale_a [M, ceil(K / 128)]``), ``b [K, N]`` in 128x128 blocks (``descale_b
    [ceil(K / 128), ceil(N / 128)]``) or in 128x1 tiles along ``K`` (``descale_b [ceil(K / 128),
    N]``).

    ``backend``: ``auto`` (``torch._scaled_mm`` where the GPU and shapes allow it, the module
    doc), ``emulated`` or ``scaled_mm`` (raises where it cannot run).
    """
    if not _uses_scaled_mm(a, b, out_dtype, backend):
        return _emulated(a, b, descale_a.to(torch.float32), descale_b.to(torch.float32), out_dtype, bias)
    # a row-major with its scales outer-dim-major; b column-major; block scales of b as the
    # transposed view of row-major [N / 128, K / 128] scales, tile scales row-major [K / 128, N]
    a = a.contiguous()
    if not b.t().is_contiguous():
        b = b.t().contiguous().t()
    sa = descale_a.to(torch.float32).t().contiguous().t()
    per_column = descale_b.shape[1] == b.shape[1]
    sb = descale_b.to(torch.float32)
    sb = sb.contiguous() if per_column else sb.t().contiguous().t()
    out = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    return _widened_with_bias(out, bias, out_dtype)


def _widened_with_bias(out: torch.Tensor, bias, out_dtype) -> torch.Tensor:
    """The bfloat16 GEMM result in ``out_dtype``, ``+ bias`` added in float32 and rounded once:
    ``(out.float() + bias.float()).to(out_dtype)``, in one pass over ``out`` (an in-place add
    computes in float32, the promoted type, and rounds into ``out``'s dtype) instead of three."""
    if out_dtype != out.dtype:
        out = out.to(out_dtype)
    if bias is not None:
        out.add_(bias if bias.dtype == torch.float32 else bias.to(torch.float32))
    return out


class _GradStage:
    """grad_output's stage: its 1x128 codes (input gradient), its 128x1 codes written as ``g^T``'s
    rows (weight gradient) and, with ``column_sum``, the bias gradient."""

    __slots__ = ("column_sum",)

    def __init__(self, column_sum: bool) -> None:
        self.column_sum = column_sum


_STAGES = {True: _GradStage(True), False: _GradStage(False)}


class BlockwiseFp8Encoder(PerCallFp8Encoder):
    """FP8 codes with one scale per tile of ``tiles`` (1x128 or 128x128), from each tile's own
    amax: ``encode_dynamic`` returns the data and ``(scale, descale, amax)``, each shaped
    ``tiles.scale_shape(x.shape)``."""

    def __init__(self, name: str, margin: int, tiles: ScaleLayout, pow2: bool) -> None:
        super().__init__(name, margin)
        self.tiles, self.pow2 = tiles, pow2

    def encode_dynamic(self, x: torch.Tensor, stage: _GradStage | None = None):
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._encode(x, stage)
        return self._encode(x, stage)  # (a Function's forward and backward: autograd already off)

    def _encode(self, x: torch.Tensor, stage: _GradStage | None):
        if self.tiles == BLOCK_128X128:
            q, scale, descale, amax, _, _ = quantize_fp8_block(x, self.dtype, self.margin, self.pow2)
            return q, scale, descale, amax
        if stage is None:
            return quantize_fp8_tile(x, self.dtype, self.margin, self.pow2)
        # g's tiles and g^T's rows, from one read where the kernel can
        q, scale, descale, amax, q_t, descale_t = quantize_fp8_tile_pair(x, self.dtype, self.margin, self.pow2)
        sums = x.sum(0, dtype=torch.float32) if stage.column_sum else None
        return (q, (q_t, descale_t), sums), scale, descale, amax


@register
class Fp8Blockwise(PerCallScales, Recipe):
    """FP8 in 1x128 tiles (activations, gradients) and 128x128 blocks (weights), each tile's
    scale from its own amax at every call (stateless)."""

    name = "fp8_blockwise"
    formats = ("e4m3", "e4m3")  # cuBLASLt's block-scaled FP8 GEMM takes E4M3 operands only
    per_call_encoder = BlockwiseFp8Encoder
    fuses_prologues = False  # the tiles' amaxes of the prologue's output come before its encode
    saves_inputs = True  # the weight gradient encodes the input along its other dimension
    # scales rounded down to powers of two (fp8_blockwise_pow2)
    pow2 = False
    shard_scales = True  # an FP8 all-gather sends each shard's own block scales with its codes
    scale_layouts = {"input": TILE_1X128, "weight": BLOCK_128X128, "grad_output": TILE_1X128}
    gemm_layouts = GemmLayouts(
        forward=(Operand("input", TILE_1X128), Operand("weight", BLOCK_128X128)),
        grad_input=(Operand("grad_output", TILE_1X128), Operand("weight", BLOCK_128X128)),
        grad_weight=(Operand("grad_output", COLUMN_TILE_128X1), Operand("input", COLUMN_TILE_128X1)),
    )
    summary = (
        "FP8 with a scale per 1x128 tile of input and grad_output and per 128x128 block of the weight, "
        "from this call's own amaxes (stateless); owners, stamps, ledger counts; recompute exact when "
        "its input is bitwise the forward's (audited)"
    )

    def __init__(self, config) -> None:
        super().__init__(config)
        warn_unless_e4m3(self.name, config, "block-scaled")

    def _make_encoder(self, role: str):
        if self.attention_role(role):
            return super()._make_encoder(role)
        name = self.config.backward_format if role == "grad_output" else self.config.forward_format
        return BlockwiseFp8Encoder(name, self.config.margin, self.scale_layout(role), self.pow2)

    def grad_output_stage(self, column_sum: bool):
        return _STAGES[column_sum]

    def bias_in_epilogue(self, device: torch.device, backend: str) -> bool:
        return False  # added in float32 after the GEMM (blockwise_matmul)

    def linear_gemm(self, xq, wq, sx, sw, out_dtype, backend, bias):
        # W^T [in, out]: its blocks are W's transposed, so are their descales
        return blockwise_matmul(xq, wq.t(), sx.descale, sw.descale.t(), out_dtype, backend, bias)

    def saved_for_backward(self, xq, wq, x2, weight):
        if getattr(weight, "fp8", None) is wq:  # FSDP2's FP8-gathered blocks: no high-precision weight here
            return x2, wq
        return x2, weight  # the backward encodes them in the layouts its GEMMs read

    def grad_weight(self, g_w, x_saved, sg, sx, out_dtype, backend):
        g_t, g_descale_t = g_w  # g^T [out, tokens] in 1x128 tiles along the tokens
        enc = self.encoder("input")  # (a backward: autograd off)
        x_t, _, x_descale_t, _ = quantize_fp8_tile_t(x_saved, enc.dtype, enc.margin, self.pow2)
        return blockwise_matmul(g_t, x_t.t(), g_descale_t, x_descale_t.t(), out_dtype, backend)

    def grad_input(self, g_x, w_saved, sg, sw, out_dtype, backend):
        enc = self.encoder("weight")
        if w_saved.dtype == enc.dtype:  # the FP8-gathered codes [out, in] and their blocks
            return blockwise_matmul(g_x, w_saved, sg.descale, sw.descale, out_dtype, backend)
        # the forward's blocks again (bitwise), written transposed: W^T's blocks and their descales,
        # already laid out as the GEMM reads them (W [out, in] column-major)
        _, _, _, _, w_t, descale_t = quantize_fp8_block(w_saved, enc.dtype, enc.margin, self.pow2)
        return blockwise_matmul(g_x, w_t.t(), sg.descale, descale_t.t(), out_dtype, backend)

    # -- FSDP2's FP8 all-gather (the module doc) ----------------------------------------
    def shard_gather_problem(self, full_shape, shard_rows):
        if len(full_shape) != 2:  # a stack of weights (experts): its dim 0 is no weight's rows
            return (
                f"recipe={self.name!r}: block scales gather with the codes of 2-D weights only, not {tuple(full_shape)}"
            )
        if len(set(shard_rows)) == 1 and shard_rows[0] % BLOCK == 0:
            return None
        return (
            f"recipe={self.name!r}: its {full_shape[0]} rows split as {shard_rows} over {len(shard_rows)} ranks; "
            f"the weight's {BLOCK}x{BLOCK} block scales gather with its codes only where every shard holds the "
            f"same number of rows, a multiple of {BLOCK} (out_features divisible by {BLOCK} x the shard group size)"
        )

    def all_gather_inputs(self, codes, snap):
        """The shard's codes as bytes and its blocks' ``scale``, ``descale`` and ``amax`` stacked
        as float32 ``[rows / 128, 3, ceil(cols / 128)]``: both split by rows, so the all-gather
        concatenates them into the full weight's."""
        return codes.view(torch.uint8), torch.stack((snap.scale, snap.descale, snap.amax), dim=1)

    def all_gathered(self, outputs, snap, dtype):
        codes, blocks = outputs
        # copies: the gathered buffers are freed after each use, the snapshot is read later
        scale, descale, amax = (blocks[:, i].clone(memory_format=torch.contiguous_format) for i in range(3))
        return codes.view(dtype), snap.with_scales(scale, descale, amax)

    def telemetry(self, snap) -> dict[str, torch.Tensor]:
        if snap.scale.numel() == 0:
            return {}
        return {"scale_min": snap.scale.min(), "scale_max": snap.scale.max(), "amax": snap.amax.max()}


@register
class Fp8BlockwisePow2(Fp8Blockwise):
    """:class:`Fp8Blockwise` with every scale rounded down to a power of two."""

    name = "fp8_blockwise_pow2"
    pow2 = True
    summary = Fp8Blockwise.summary + "; scales rounded down to powers of two"
